"""Async HTTP client for the HTTP engines (SGLang's `/generate`, vLLM's `/v1/completions`), with retries.

- A request without a `routing_key` goes to the least-loaded URL (fewest in flight, round robin
  among equals). Requests with the same `routing_key` (agent turns set the session id) go to
  the same URL, so a session's turns find its prefix in that server's KV cache: rendezvous
  hashing of key and URL over the URLs that are up, with bounded load (a URL holding more than
  `pipeline.core.affinity.bound` of the mean, and more than `DEFAULT_SLACK` above the least
  loaded, is passed over, as the server's router does between workers). Behind one gateway URL the gateway
  chooses the server: the `Wire` names the header that carries the key to it.
- A URL that fails to connect is avoided for a short cool-down.
- One pool of connections (`aiohttp_transport`, behind httpx's API); at most `max_in_flight`
  generation calls outstanding at once.
- Connection errors and 5xx answers are retried with exponential backoff (each attempt under a
  fresh request id); 4xx answers and read timeouts are not.
- A call cancelled while in flight (the batch failed elsewhere, or the worker was interrupted)
  is aborted on the server it went to (the `Wire`'s abort: SGLang's `/abort_request` per rid,
  behind a gateway on every server behind it; vLLM's `/abort_requests`), so the server stops
  generating for nobody. `abort_sent` aborts every call in flight that way (a partial swap).

A call given a `StreamSink` is sent with `stream: true` (and the sink's `fields`): each chunk goes
to the sink as it arrives (a streamed agent turn's progress), and the sink's `answer()` is the
call's answer, the body a non-streamed call gets; an error chunk is the server refusing the call; a
stream cut before its `[DONE]` is a lost answer (retried, as a dropped connection is).

What differs between servers is a `Wire`: the generation path, the server's name in errors, the
ids a call is tracked under and how to abort them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, DEFAULT_SLACK, bound, rank
from schemas.request import RolloutRequest
from workers.engines.http.aiohttp_transport import AiohttpTransport
from workers.engines.http.backends import Answer, Backends, error_message
from workers.errors import ContractViolation, EngineUnavailableError, UnsupportedRequestError
from workers.runtime import logs
from workers.runtime.backoff import backoff_s

log = logging.getLogger(__name__)
# httpx logs every request at INFO (thousands a second on a busy worker): DEBUG here.
logs.demote_to_debug("httpx")

# Transport failures worth another attempt: nothing was generated, or the answer was lost.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError,
              httpx.ReadError, httpx.WriteError)
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


_JSON_HEADERS = {"content-type": "application/json"}
CONTROL_CONNECTIONS = 16  # connections beyond `max_in_flight`: aborts and lifecycle calls under a full load


def _encoded(payload: Any) -> bytes:
    """A call's JSON body, encoded by orjson (a long prompt's ids are most of it)."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _decoded(response: httpx.Response) -> Any:
    """An answer's JSON body; raises ValueError when it is not JSON. orjson first; Python's parser for
    what only it reads (NaN, Infinity)."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.json()


class Call(Protocol):
    """One HTTP generation call: its request, its id and JSON body."""

    @property
    def request(self) -> RolloutRequest: ...

    @property
    def rid(self) -> str: ...

    @property
    def payload(self) -> dict[str, Any]: ...

    def with_rid(self, rid: str) -> Call:
        """The same call under another id (a retry)."""
        ...


Aborts = dict[str, dict[str, Answer]]
"""What each server answered to the abort of each id: {id: {server URL: answer}}."""


@dataclass(frozen=True)
class Wire:
    """What one kind of server needs of the client."""

    server: str  # the server's name in errors: "SGLang", "vLLM"
    path: str  # where generation calls go: "/generate", "/v1/completions"
    ids: Callable[[Any], list[str]]  # the ids the server tracks a call under
    # Abort these ids on the server(s) behind the URL the call went to, within a timeout.
    abort: Callable[[str, list[str], float], Awaitable[Aborts]]
    # The header that carries a request's routing key to a gateway in front of the servers (None: not sent).
    routing_header: str | None = None


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    down_cooldown_s: float = 5.0

    def delay(self, retry: int) -> float:
        """Seconds before retry number `retry` (1-based): exponential, with jitter."""
        return backoff_s(retry, self.backoff_s, self.max_backoff_s)


class ServerPool:
    """Picks a URL per request, skipping recently unreachable ones: by its routing key (rendezvous
    hashing with bounded load) or, without one, least in flight."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise EngineUnavailableError("an HTTP engine needs at least one --url http://host:port")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.sent = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._turn = 0

    def acquire(self, avoid: str | None = None, key: str | None = None) -> str:
        now = time.monotonic()
        candidates = [u for u in self.urls if self._down_until[u] <= now and u != avoid]
        candidates = candidates or [u for u in self.urls if u != avoid] or self.urls
        least = min(self.in_flight[u] for u in candidates)
        if len(candidates) == 1:
            url = candidates[0]
        elif key is not None:
            total = sum(self.in_flight[u] for u in candidates)
            limit = max(bound(total, len(candidates), DEFAULT_LOAD_FACTOR), least + DEFAULT_SLACK)
            url = max((u for u in candidates if self.in_flight[u] + 1 <= limit), key=lambda u: rank(key, u))
        else:
            tied = [u for u in candidates if self.in_flight[u] == least]
            url = tied[self._turn % len(tied)]
            self._turn += 1
        self.in_flight[url] += 1
        self.sent[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1

    def mark_down(self, url: str, seconds: float) -> None:
        self._down_until[url] = time.monotonic() + seconds


class StreamSink(Protocol):
    """Where a streamed call's chunks go: its tokens so far, and the answer they add up to."""

    fields: dict[str, Any]  # what the body adds to `stream: true` (vLLM's `stream_options`)

    def take(self, chunk: Any) -> None: ...

    def so_far(self) -> list[int]:
        """The call's token ids so far (a single-sample call)."""
        ...

    def answer(self) -> Any:
        """The body a non-streamed call would have been answered with."""
        ...


class GenerateClient:
    """All generation traffic of an HTTP engine. Use from one event loop."""

    def __init__(
        self,
        urls: Sequence[str],
        wire: Callable[[Backends], Wire],
        *,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        max_in_flight: int = 256,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.pool = ServerPool(urls)
        self.backends = Backends(self.pool.urls, lambda: self.client, connect_timeout_s=connect_timeout_s)
        self.wire = wire(self.backends)
        self.retry = retry or RetryPolicy()
        self.max_in_flight = max_in_flight
        self.aborted: list[str] = []  # ids we asked servers to abort (for logs and tests)
        self._sent: dict[str, tuple[str, Call]] = {}  # attempt rid -> (URL, call) awaiting an answer
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
        self._transport = transport
        self._targets: dict[str, httpx.URL] = {}  # server URL -> its generation URL, parsed once
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """Where every call goes: the one given, else aiohttp (`aiohttp_transport`), with room for
        the lifecycle calls and aborts beside a full load of generation calls."""
        if self._transport is None:
            self._transport = AiohttpTransport(max_connections=self.max_in_flight + CONTROL_CONNECTIONS)
        return self._transport

    @property
    def client(self) -> httpx.AsyncClient:
        """An httpx client over `transport`, for the lifecycle calls (generation calls skip its layers)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, transport=self.transport)
        return self._client

    def sent(self) -> set[str]:
        """The request ids of the calls sent and not answered yet."""
        return set(self._sent)

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        return self._slots

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()  # closes the transport too
            self._client = None
        elif self._transport is not None:
            await self._transport.aclose()

    # -- generation --------------------------------------------------------------------------

    async def generate(self, call: Call, sink: Callable[[], StreamSink] | None = None) -> tuple[str, Any]:
        """POST one call, retrying transient failures; (url, JSON body). With `sink` (a new sink for
        each attempt), streamed."""
        who = f"request {call.request.id!r}"
        last_error = "no attempt made"
        avoid: str | None = None
        key = call.request.routing_key
        headers = {self.wire.routing_header: key} if key is not None and self.wire.routing_header else None
        for attempt in range(self.retry.attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt))
            attempt_call = call if attempt == 0 else call.with_rid(f"{call.rid}-r{attempt}")
            async with self.slots:
                url = self.pool.acquire(avoid, key)
                self._sent[attempt_call.rid] = (url, attempt_call)
                try:
                    response = await self._post(url, attempt_call, headers, None if sink is None else sink())
                except _RETRYABLE as exc:
                    last_error = f"{url}: {type(exc).__name__}: {exc or 'connection failed'}"
                    log.warning("%s attempt %d failed: %s", who, attempt + 1, last_error)
                    self.pool.mark_down(url, self.retry.down_cooldown_s)
                    if not isinstance(exc, _NOT_SENT):  # the server may still be generating it
                        await self._abort_quietly(url, attempt_call)
                    avoid = url
                    continue
                except httpx.TimeoutException as exc:
                    await self._abort_quietly(url, attempt_call)
                    raise EngineUnavailableError(
                        f"{who}: {self.wire.server} server {url} did not answer within the timeout "
                        f"({type(exc).__name__})"
                    ) from exc
                except asyncio.CancelledError:
                    await self._abort_quietly(url, attempt_call)
                    raise
                finally:
                    self.pool.release(url)
                    self._sent.pop(attempt_call.rid, None)
            if response.status_code >= 500:
                last_error = f"{url}: HTTP {response.status_code}: {error_message(response)}"
                log.warning("%s attempt %d failed: %s", who, attempt + 1, last_error)
                avoid = url
                continue
            if response.status_code >= 400:
                raise UnsupportedRequestError(
                    f"{who}: {self.wire.server} server {url} rejected it with HTTP {response.status_code}: "
                    f"{error_message(response)}"
                )
            try:
                return url, _decoded(response)
            except ValueError as exc:
                raise ContractViolation(
                    f"{who}: {self.wire.server} server {url} answered {self.wire.path} with a body that is not JSON: "
                    f"{response.text[:200]!r}"
                ) from exc
        raise EngineUnavailableError(
            f"{who}: no {self.wire.server} server answered after {self.retry.attempts} attempts; "
            f"last error: {last_error}"
        )

    def _request(self, url: str, headers: dict[str, str] | None, body: Any) -> httpx.Request:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = httpx.URL(f"{url}{self.wire.path}")
        headers = _JSON_HEADERS if headers is None else {**_JSON_HEADERS, **headers}
        return httpx.Request("POST", target, content=_encoded(body), headers=headers,
                             extensions={"timeout": self._timeout.as_dict()})

    async def _post(self, url: str, call: Call, headers: dict[str, str] | None,
                    sink: StreamSink | None) -> httpx.Response:
        """The call's answer, read whole; streamed into `sink` when given, then answered as the sink
        assembles it. Sent straight to the transport: httpx's client layers (auth, redirects,
        cookies, hooks) have nothing to do here and cost a fifth of a call."""
        body = call.payload if sink is None else {**call.payload, "stream": True, **sink.fields}
        request = self._request(url, headers, body)
        response = await self.transport.handle_async_request(request)
        log.debug("POST %s: HTTP %d", request.url, response.status_code)
        try:
            if sink is None or response.status_code >= 400:
                await response.aread()
                return response
            return await self._streamed(url, call, response, sink)
        finally:
            await response.aclose()

    async def _streamed(self, url: str, call: Call, response: httpx.Response, sink: StreamSink) -> httpx.Response:
        """A streamed answer's chunks into `sink`, then the answer they make up."""
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise ContractViolation(f"request {call.request.id!r}: {self.wire.server} server {url} streamed "
                                        f"a chunk that is not JSON: {data[:200]!r}") from exc
            if isinstance(chunk, dict) and "error" in chunk:  # `generate_request`'s error chunk
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                status = error.get("code") if isinstance(error.get("code"), int) else 400
                return httpx.Response(status, json=chunk, request=response.request)
            chunks += 1
            sink.take(chunk)
        else:
            raise httpx.RemoteProtocolError("the stream ended before its [DONE]", request=response.request)
        if not chunks:
            raise ContractViolation(f"request {call.request.id!r}: {self.wire.server} server {url} streamed "
                                    "no answer before [DONE]")
        return httpx.Response(200, json=sink.answer(), request=response.request)

    async def abort_sent(self, timeout_s: float = 10.0, *, only: set[str] | None = None) -> Aborts:
        """Abort every call sent and not answered yet (or those of them whose request ids are in
        `only`), on the server it went to: only this client's requests stop, not those of other
        workers sharing the servers. What each server answered, per id."""
        targets = [(url, self.wire.ids(call)) for rid, (url, call) in list(self._sent.items())
                   if only is None or rid in only]
        self.aborted.extend(i for _, ids in targets for i in ids)
        answers = await asyncio.gather(*(self.wire.abort(url, ids, timeout_s) for url, ids in targets))
        return {i: per_server for per_call in answers for i, per_server in per_call.items()}

    async def _abort_quietly(self, url: str, call: Call) -> None:
        """Best effort abort of a call on the server(s) behind `url`; never raises."""
        ids = self.wire.ids(call)
        self.aborted.extend(ids)
        for i, answers in (await self.wire.abort(url, ids, 5.0)).items():
            for server, answer in answers.items():
                if not isinstance(answer, httpx.Response):
                    log.warning("could not abort %s on %s: %s", i, server, answer)

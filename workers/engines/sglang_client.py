"""Async HTTP client for one or more SGLang servers (or routers): `/generate` with retries.

- Requests go to the least-loaded URL (fewest in flight, round robin among equals); a URL that
  fails to connect is avoided for a short cool-down.
- One pooled `httpx.AsyncClient`; at most `max_in_flight` requests outstanding at once.
- Connection errors and 5xx answers are retried with exponential backoff (each attempt under a
  fresh rid); 4xx answers and read timeouts are not.
- A call cancelled while in flight (the batch failed elsewhere, or the worker was interrupted)
  sends `POST /abort_request` for its rids, so the server stops generating for nobody; behind a
  gateway, to every server behind it (`sglang_backends`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from workers import logs
from workers.backoff import backoff_s
from workers.engines.sglang_backends import Answer, Backends, error_message
from workers.engines.sglang_mapping import GenerateCall
from workers.errors import ContractViolation, EngineUnavailableError, UnsupportedRequestError

log = logging.getLogger(__name__)
# httpx logs every request at INFO (thousands a second on a busy worker): DEBUG here.
logs.demote_to_debug("httpx")

# Transport failures worth another attempt: nothing was generated, or the answer was lost.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError,
              httpx.ReadError, httpx.WriteError)
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


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
    """Picks a URL per request: least in flight, skipping recently unreachable ones."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise EngineUnavailableError("sglang-http needs at least one --url")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.sent = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._turn = 0

    def acquire(self, avoid: str | None = None) -> str:
        now = time.monotonic()
        candidates = [u for u in self.urls if self._down_until[u] <= now and u != avoid]
        candidates = candidates or [u for u in self.urls if u != avoid] or self.urls
        least = min(self.in_flight[u] for u in candidates)
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


class SGLangClient:
    """All HTTP traffic of the sglang-http engine. Use from one event loop."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        max_in_flight: int = 256,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.pool = ServerPool(urls)
        self.backends = Backends(self.pool.urls, lambda: self.client, connect_timeout_s=connect_timeout_s)
        self.retry = retry or RetryPolicy()
        self.max_in_flight = max_in_flight
        self.aborted: list[str] = []  # rids we asked servers to abort (for logs and tests)
        self._sent: dict[str, tuple[str, GenerateCall]] = {}  # attempt rid -> (URL, call) awaiting an answer
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=limits, transport=self._transport)
        return self._client

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        return self._slots

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- generation --------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> tuple[str, Any]:
        """POST one call, retrying transient failures; (url, JSON body)."""
        who = f"request {call.request.id!r}"
        last_error = "no attempt made"
        avoid: str | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt))
            attempt_call = call if attempt == 0 else call.with_rid(f"{call.rid}-r{attempt}")
            async with self.slots:
                url = self.pool.acquire(avoid)
                self._sent[attempt_call.rid] = (url, attempt_call)
                try:
                    response = await self.client.post(f"{url}/generate", json=attempt_call.payload)
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
                        f"{who}: SGLang server {url} did not answer within the timeout ({type(exc).__name__})"
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
                    f"{who}: SGLang server {url} rejected it with HTTP {response.status_code}: "
                    f"{error_message(response)}"
                )
            try:
                return url, response.json()
            except ValueError as exc:
                raise ContractViolation(
                    f"{who}: SGLang server {url} answered /generate with a body that is not JSON: "
                    f"{response.text[:200]!r}"
                ) from exc
        raise EngineUnavailableError(
            f"{who}: no SGLang server answered after {self.retry.attempts} attempts; last error: {last_error}"
        )

    async def abort_sent(self, timeout_s: float = 10.0) -> dict[str, dict[str, Answer]]:
        """`/abort_request` by rid for every call sent and not answered yet, on the server it went
        to (behind a gateway, on every server behind it): only this client's requests stop, not
        those of other workers sharing the servers. What each server answered, per SGLang rid."""
        targets = [(rid, url) for url, call in self._sent.values() for rid in call.sglang_rids]
        self.aborted.extend(rid for rid, _ in targets)
        answers = await asyncio.gather(*(self.backends.abort(rid, via=url, timeout_s=timeout_s)
                                         for rid, url in targets))
        return {rid: per_server for (rid, _), per_server in zip(targets, answers, strict=True)}

    async def _abort_quietly(self, url: str, call: GenerateCall) -> None:
        """Best effort `/abort_request` for a call's rids on the server(s) behind `url`; never raises."""
        for rid in call.sglang_rids:
            self.aborted.append(rid)
            answers = await self.backends.abort(rid, via=url, timeout_s=5.0)
            for server, answer in answers.items():
                if not isinstance(answer, httpx.Response):
                    log.warning("could not abort %s on %s: %s", rid, server, answer)

"""The servers behind an HTTP engine's URLs, calls fanned out to each of them, and what they answer.

Shared by the `sglang-http` and `vllm-http` engines (this package is below both). A URL is either
a server or, for SGLang, a gateway/router or a gateway/router (`smg`, `sglang-router`) in front of
several. Gateways forward `/generate` but not the lifecycle calls (`/update_weights_from_disk`,
`/pause_generation`, `/continue_generation`, `/abort_request` answer 404 there), so those go
to every server directly. A gateway is recognised by `GET /workers`, which lists its servers
(`{"workers": [{"url": ...}, ...]}`); an SGLang server answers it 404.

The server list is read at start (`discover`) and read again when a push begins and whenever a
fanned-out call fails: servers come and go behind a gateway. Before `discover`, every URL
counts as a server of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from workers.errors import EngineUnavailableError

log = logging.getLogger(__name__)

Answer = httpx.Response | httpx.HTTPError
"""What one server answered to a fanned-out call, or why it could not be reached."""

NOT_A_GATEWAY = (404, 405)  # what an SGLang server answers to GET /workers


def answered(answer: Answer) -> bool:
    """The server was reached and did not answer an HTTP error."""
    return isinstance(answer, httpx.Response) and answer.status_code < 400


def error_message(response: httpx.Response) -> str:
    """SGLang's error text: `{"error": {"message"}}`, `{"error": "..."}`, `{"detail"}` or the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:500]
    return str(body)[:500]


def parse_weight_version(value: Any) -> int | None:
    """A server's weight_version: SGLang's is a string ("default" until set), vLLM's an integer; ours are integers."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def describe_answer(url: str, answer: Answer) -> str:
    """One failed answer in words, naming the server."""
    if isinstance(answer, httpx.HTTPError):
        return (f"{url}: cannot connect ({type(answer).__name__}: {answer or 'connection failed'}); "
                "is the server running and reachable from this worker?")
    return f"{url}: HTTP {answer.status_code}: {error_message(answer)}"


class Backends:
    """Which SGLang servers each engine URL stands for; calls addressed to all of them."""

    def __init__(self, urls: Sequence[str], http: Callable[[], httpx.AsyncClient], *,
                 discovery_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._http = http
        self._connect_timeout_s = connect_timeout_s
        self._discovery_timeout = self._timeout(discovery_timeout_s)
        self._behind: dict[str, list[str]] = {u: [u] for u in self.urls}
        self._listed: dict[str, dict[str, Any]] = {}  # server URL -> its gateway's /workers entry
        self._discovered = False
        self.gateways: set[str] = set()

    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=min(seconds, self._connect_timeout_s))

    def servers(self, via: str | None = None) -> list[str]:
        """Every known server (each once, in URL order), or only those behind the URL `via`."""
        lists = [self._behind.get(via, [via])] if via is not None else self._behind.values()
        return list(dict.fromkeys(s for servers in lists for s in servers))

    # -- discovery -----------------------------------------------------------------------------

    async def discover(self) -> None:
        """Read the servers behind every URL; raises `EngineUnavailableError` naming each URL that
        cannot be read (unreachable, or a gateway without a usable `GET /workers`)."""
        targets = sorted(self.gateways) if self._discovered else self.urls
        found = await asyncio.gather(*(self._servers_behind(url) for url in targets), return_exceptions=True)
        for failure in found:
            if isinstance(failure, BaseException) and not isinstance(failure, EngineUnavailableError):
                raise failure
        errors = [str(f) for f in found if isinstance(f, EngineUnavailableError)]
        if errors:
            raise EngineUnavailableError("cannot find the SGLang servers: " + "; ".join(errors))
        for url, listed in zip(targets, found, strict=True):
            assert isinstance(listed, dict)
            before = self._behind.get(url)
            self._behind[url] = list(listed)
            if listed != {url: {}}:
                self.gateways.add(url)
                self._listed.update(listed)
                if self._discovered and set(before or ()) != set(listed):
                    log.info("the gateway %s now lists %s (was %s)", url, list(listed), before)
        known = self.servers()
        self._listed = {server: entry for server, entry in self._listed.items() if server in known}
        self._discovered = True

    def describe(self, url: str, answer: Answer) -> str:
        """A server's failed answer in words; for a server behind a gateway, how the gateway lists
        it and how to take it out if it is gone for good."""
        text = describe_answer(url, answer)
        gateway = next((g for g in sorted(self.gateways) if url in self._behind[g]), None)
        if gateway is None:
            return text
        entry = self._listed.get(url, {})
        state = ", ".join(f"{key}={entry[key]}" for key in ("status", "is_healthy") if key in entry)
        return (f"{text} (the gateway {gateway} lists it{': ' + state if state else ''}; if it is gone for good, "
                f"take it out of the gateway: DELETE {gateway}/workers/{entry.get('id', '<id>')})")

    async def _servers_behind(self, url: str) -> dict[str, dict[str, Any]]:
        """The servers a gateway lists (URL -> its `/workers` entry), or `{url: {}}` for a server."""
        try:
            response = await self._http().get(f"{url}/workers", timeout=self._discovery_timeout)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(describe_answer(url, exc)) from exc
        if response.status_code in NOT_A_GATEWAY and url not in self.gateways:
            return {url: {}}
        if response.status_code >= 400:
            raise EngineUnavailableError(
                f"{url}: the gateway's GET /workers answered HTTP {response.status_code}: "
                f"{error_message(response)}; the worker needs its server list to send weight updates, "
                "pauses and aborts to each server"
            )
        try:
            servers = _worker_urls(response)
        except ValueError as exc:
            raise EngineUnavailableError(f"{url}: GET /workers: {exc}") from exc
        if not servers:
            raise EngineUnavailableError(
                f"{url}: the gateway lists no SGLang servers (GET /workers is empty); start the servers "
                "or register them (smg launch --worker-urls ..., or POST /workers {\"url\": ...})"
            )
        return servers

    # -- calls to every server -----------------------------------------------------------------

    async def each(self, method: str, path: str, json: Any = None, *, timeout_s: float | None = None,
                   servers: Iterable[str] | None = None) -> dict[str, Answer]:
        """The same call on every server (or on `servers`) at once, as they are known now."""
        targets = list(servers) if servers is not None else self.servers()
        timeout: Any = httpx.USE_CLIENT_DEFAULT if timeout_s is None else self._timeout(timeout_s)

        async def one(url: str) -> Answer:
            try:
                return await self._http().request(method, f"{url}{path}", json=json, timeout=timeout)
            except httpx.HTTPError as exc:
                return exc

        return dict(zip(targets, await asyncio.gather(*(one(u) for u in targets)), strict=True))

    async def fan_out(self, method: str, path: str, json: Any = None, *, timeout_s: float | None = None,
                      rediscover: bool = False) -> dict[str, Answer]:
        """`each`, reading the servers behind the gateways again first when `rediscover`, and
        again after a failure: a server that left is dropped from the answers, one that
        joined is called too. Failures that remain are in the answers, for the caller to judge."""
        if rediscover and self.gateways:
            await self.discover()
        answers = await self.each(method, path, json, timeout_s=timeout_s)
        if not self.gateways or all(answered(a) for a in answers.values()):
            return answers
        try:
            await self.discover()
        except EngineUnavailableError as exc:
            log.warning("after %s %s failed on some server, the server list could not be read again: %s",
                        method, path, exc)
            return answers
        now = self.servers()
        gone = [url for url in answers if url not in now]
        if gone:
            log.info("%s %s: %s left the gateway meanwhile; not counted", method, path, gone)
        answers = {url: a for url, a in answers.items() if url in now}
        joined = [url for url in now if url not in answers]
        if joined:
            answers.update(await self.each(method, path, json, timeout_s=timeout_s, servers=joined))
        return {url: answers[url] for url in now}

    async def abort(self, rid: str, *, via: str | None = None, timeout_s: float | None = None) -> dict[str, Answer]:
        """`POST /abort_request {"rid"}` on every server (or those behind `via`): behind a gateway
        the worker does not know which server holds the request. SGLang ignores unknown rids."""
        if via is None:
            return await self.fan_out("POST", "/abort_request", {"rid": rid}, timeout_s=timeout_s)
        return await self.each("POST", "/abort_request", {"rid": rid}, timeout_s=timeout_s,
                               servers=self.servers(via))

    async def abort_all(self, *, timeout_s: float | None = None) -> dict[str, Answer]:
        """`POST /abort_request {"abort_all": true}` on every server: everything in flight stops."""
        return await self.fan_out("POST", "/abort_request", {"abort_all": True}, timeout_s=timeout_s)


def _worker_urls(response: httpx.Response) -> dict[str, dict[str, Any]]:
    """The servers of a gateway's `GET /workers` answer (URL -> entry); ValueError saying what is wrong."""
    try:
        body = response.json()
    except ValueError:
        body = None
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) and isinstance(w.get("url"), str)
                                                  for w in workers):
        raise ValueError(
            f"answered {response.text[:200]!r}, not a gateway's {{\"workers\": [{{\"url\": ...}}]}}; "
            "use smg >= 1.13 or sglang-router 0.3, or give the SGLang servers' own URLs"
        )
    listed = {w["url"].rstrip("/"): w for w in workers}
    other = [u for u in listed if urlsplit(u).scheme not in ("http", "https")]
    if other:
        raise ValueError(
            f"the gateway lists {other}, which the worker cannot call over HTTP; weight updates, "
            "pauses and aborts need each SGLang server's HTTP URL"
        )
    return listed

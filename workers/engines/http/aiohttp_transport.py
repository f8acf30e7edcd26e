"""An httpx transport that sends over aiohttp: httpx's API and seam, aiohttp's cost per call.

The HTTP engines speak httpx (requests, responses, exceptions, and `httpx.MockTransport` in tests),
but httpx costs ~0.7-1.4 ms of CPU a call here: its client layers, and a connection pool that
re-checks every idle connection's socket before each request, a cost that grows with the pool (a
worker holds one connection per call in flight: hundreds on a big batch); aiohttp's pool hands out
an idle connection without looking at the others. `benchmarks/http_client.py` measures both.

aiohttp's failures become httpx's, so that the callers' retry rule holds: a call that may have
reached the server (`RemoteProtocolError`, `ReadError`) is distinguished from one that never left
(`ConnectError`, `ConnectTimeout`); a read timeout is `ReadTimeout`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx

# Idle connections are closed after this long: under the 5 s after which uvicorn (SGLang's and
# vLLM's HTTP server) closes them itself, so a call never picks a connection the server is closing.
KEEPALIVE_S = 4.0

# aiohttp's failure -> httpx's, most specific first (aiohttp's classes inherit from one another).
_FAILURES: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ClientConnectorError, httpx.ConnectError),  # never connected: nothing was sent
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.ReadError),
    (aiohttp.ClientConnectionError, httpx.ReadError),  # reset or broken while sending or reading
    (aiohttp.InvalidUrlClientError, httpx.UnsupportedProtocol),
    (aiohttp.ClientError, httpx.TransportError),
)


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except aiohttp.ClientError as exc:
        failure = next(theirs for ours, theirs in _FAILURES if isinstance(exc, ours))
        raise failure(str(exc) or type(exc).__name__, request=request) from exc


class _Body(httpx.AsyncByteStream):
    """A response's body as aiohttp reads it; closing it gives the connection back (or drops it,
    when the body was not read to the end)."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over one `aiohttp.ClientSession`, made on first use in the running event loop; use
    it from that loop only. At most `max_connections` open at once."""

    def __init__(self, *, max_connections: int) -> None:
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _opened(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  skip_auto_headers=("User-Agent",))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.get("connect"),
                                        sock_read=timeouts.get("read"))
        with _as_httpx(request):
            response = await self._opened().request(
                request.method, str(request.url), headers=request.headers, data=request.content or None,
                allow_redirects=False, timeout=timeout,
            )
        return httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response, request),
                              request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

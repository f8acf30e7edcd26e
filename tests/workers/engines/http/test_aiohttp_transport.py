"""`AiohttpTransport` against a real socket server that misbehaves on cue: connections are kept
and reused, a streamed body arrives as it is sent, and each way a call can fail becomes the httpx
failure the engines' retry rule reads (sent or not sent, timed out)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from workers.engines.http.aiohttp_transport import AiohttpTransport

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")), 0)
    return await reader.readexactly(length)


def _answer(body: bytes, status: int = 200) -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(body))
            + body)


class Server:
    """A TCP server running `script` on each connection; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.script(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        self.server.close()


def post(url: str, body: bytes = b'{"x": 1}', read_s: float = 5.0) -> httpx.Request:
    return httpx.Request("POST", f"{url}/generate", content=body, headers={"content-type": "application/json"},
                         extensions={"timeout": {"connect": 5.0, "read": read_s, "write": 5.0, "pool": None}})


async def _send(transport: AiohttpTransport, request: httpx.Request) -> httpx.Response:
    response = await transport.handle_async_request(request)
    try:
        await response.aread()
    finally:
        await response.aclose()
    return response


def test_answers_come_back_whole_and_one_connection_serves_call_after_call() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await _read_request(reader)
            writer.write(_answer(b'{"echo": ' + body + b"}", status=201))
            await writer.drain()

    async def go() -> None:
        server = Server(echo)
        transport = AiohttpTransport(max_connections=4)
        async with server as url:
            for k in range(3):
                response = await _send(transport, post(url, b'{"k": %d}' % k))
                assert response.status_code == 201
                assert response.json() == {"echo": {"k": k}}
                assert response.headers["content-type"] == "application/json"
        await transport.aclose()
        assert server.connections == 1

    asyncio.run(go())


def test_a_streamed_body_is_read_as_it_is_sent() -> None:
    first_read = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for line in (b'data: {"n": 1}\n\n', None, b"data: [DONE]\n\n"):
            if line is None:
                await first_read.wait()  # the rest only once the client has read the first chunk
                continue
            writer.write(b"%x\r\n%s\r\n" % (len(line), line))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def go() -> list[str]:
        transport = AiohttpTransport(max_connections=4)
        lines = []
        async with Server(stream) as url:
            response = await transport.handle_async_request(post(url))
            try:
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)
                        first_read.set()
            finally:
                await response.aclose()
        await transport.aclose()
        return lines

    assert asyncio.run(go()) == ['data: {"n": 1}', "data: [DONE]"]


def test_a_body_left_unread_does_not_leave_its_connection_to_the_next_call() -> None:
    async def long_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(_answer(b"[" + b"1," * 200_000 + b"1]"))
            await writer.drain()

    async def go() -> None:
        server = Server(long_answer)
        transport = AiohttpTransport(max_connections=4)
        async with server as url:
            response = await transport.handle_async_request(post(url))
            await response.aclose()  # given up on, unread
            assert len((await _send(transport, post(url))).json()) == 200_001
        await transport.aclose()
        assert server.connections == 2

    asyncio.run(go())


async def _closed_port() -> str:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return f"http://127.0.0.1:{port}"


async def _hang_up_after_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)  # then close: the call was sent, its answer lost


async def _cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")  # then close, 90 bytes short
    await writer.drain()


async def _never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    await reader.read()  # until the client gives up and closes


@pytest.mark.parametrize(("script", "failure"), [
    (None, httpx.ConnectError),  # nothing listens: never sent
    (_hang_up_after_reading, httpx.RemoteProtocolError),  # sent, answer lost: retried and aborted
    (_cut_body, httpx.ReadError),
    (_never_answer, httpx.ReadTimeout),  # not retried: the server may still be generating
])
def test_each_failure_is_the_httpx_failure_the_retry_rule_reads(script: Script | None,
                                                                 failure: type[httpx.HTTPError]) -> None:
    async def go() -> None:
        transport = AiohttpTransport(max_connections=4)
        try:
            if script is None:
                with pytest.raises(failure) as raised:
                    await _send(transport, post(await _closed_port()))
            else:
                async with Server(script) as url:
                    with pytest.raises(failure) as raised:
                        await _send(transport, post(url, read_s=0.3))
            assert type(raised.value) is failure
            assert raised.value.request.url.path == "/generate"
        finally:
            await transport.aclose()

    asyncio.run(go())

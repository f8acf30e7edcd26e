"""CPU per generation call of the HTTP engines' client: the engine's own path against httpx.

A local HTTP server in its own process answers every `POST /generate` at once with an SGLang
result (16 tokens with logprobs), so what is measured is the client's CPU (`time.process_time`
per call) for a 3 000-token prompt. Three clients, each after a 64-connection warm-up, in turns
within each repeat:

- `httpx` (the baseline): `httpx.AsyncClient.post` with a pool as large as the engine's, the
  client a competent user writes, and what the engine used before `aiohttp_transport`;
- `engine/httpx`: the engine's `GenerateClient.generate` (routing, retries, parsing) over httpx's
  own transport;
- `engine`: the same over its default transport (aiohttp underneath).

Prints each client's median ms of CPU per call with the spread over repeats, at 1 and at 32
calls in flight, and the ratio to the baseline within each repeat.

    .venv/bin/python benchmarks/http_client.py [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import free_port
from schemas.request import RolloutRequest
from workers.engines.sglang.client import SGLangClient
from workers.engines.sglang.mapping import generate_calls

PROMPT = list(range(3000))
_ANSWER = json.dumps({
    "text": "x" * 60, "output_ids": list(range(16)),
    "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, i, None] for i in range(16)],
                  "cached_tokens": 0, "weight_version": "0"},
}).encode()
_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_ANSWER) + _ANSWER


def _serve(port: int) -> None:
    """Answer every request on every connection at once (keep-alive)."""

    class Answering(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                length = next((int(line.split(b":")[1]) for line in self.buffer[:end].lower().split(b"\r\n")
                               if line.startswith(b"content-length:")), 0)
                if len(self.buffer) < end + 4 + length:
                    return
                self.buffer = self.buffer[end + 4 + length:]
                self.transport.write(_RESPONSE)  # type: ignore[attr-defined]

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Answering, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


async def _cpu_per_call(call: Callable[[], Awaitable[object]], calls: int, in_flight: int) -> float:
    slots = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with slots:
            await call()

    start = time.process_time()
    await asyncio.gather(*(one() for _ in range(calls)))
    return (time.process_time() - start) / calls * 1000


async def _measure(url: str, calls: int, repeats: int) -> dict[tuple[str, int], list[float]]:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": PROMPT,
                                             "sampling_params": {"max_new_tokens": 16}, "logprobs": 0})
    [the_call] = generate_calls(request)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    baseline = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600, connect=10, pool=None))
    over_httpx = SGLangClient([url], transport=httpx.AsyncHTTPTransport(limits=limits))
    engine = SGLangClient([url])
    body = json.dumps(the_call.payload).encode()

    async def with_httpx() -> object:
        response = await baseline.post(f"{url}/generate", content=body, headers={"content-type": "application/json"})
        return response.json()

    clients: dict[str, Callable[[], Awaitable[object]]] = {
        "httpx": with_httpx,
        "engine/httpx": lambda: over_httpx.generate(the_call),
        "engine": lambda: engine.generate(the_call),
    }
    for call in clients.values():  # open 64 connections in each pool
        await asyncio.gather(*(call() for _ in range(64)))
    figures: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for in_flight in (1, 32):
            for name, call in clients.items():
                figures.setdefault((name, in_flight), []).append(await _cpu_per_call(call, calls, in_flight))
    await baseline.aclose()
    await over_httpx.aclose()
    await engine.aclose()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per client per repeat and concurrency")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.post(f"{url}/generate", content=b"{}", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise SystemExit("the local server did not come up") from None
            time.sleep(0.1)
    try:
        figures = asyncio.run(_measure(url, args.calls, args.repeats))
    finally:
        server.terminate()
        server.join()
    print(f"CPU ms per call, median (min-max) over {args.repeats} repeats of {args.calls} calls; "
          "ratio to httpx within each repeat")
    for in_flight in (1, 32):
        base = figures[("httpx", in_flight)]
        for name in ("httpx", "engine/httpx", "engine"):
            values = figures[(name, in_flight)]
            ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
            print(f"  {in_flight:>2} in flight  {name:<13} {statistics.median(values):6.3f} "
                  f"({min(values):.3f}-{max(values):.3f})  x{ratio:.2f}")


if __name__ == "__main__":
    main()

"""What the HTTP engines (`sglang-http`, `vllm-http`) share: batches on a private event loop, the
concurrent interface (`submit`, `load`, `capacity`), partial-swap interrupts and `decode`.

A subclass supplies the client (`http_client.GenerateClient` with its server's `Wire`), how a
request splits into calls (`_plan`) and how an answer becomes samples (`_parse`). Every call of
a batch is sent at once (bounded by the client's `max_in_flight`) so the server's continuous
batching stays full.

Partial weight swaps (`interrupt`): the client aborts each of this worker's calls in flight on the
server it went to (`GenerateClient.abort_sent`), so other workers sharing the servers keep
theirs. The servers answer each aborted call normally, with the tokens generated so far and a
finish of kind "abort"; those become interrupted samples (`Finish("abort", message=INTERRUPTED)`)
which the worker continues on the new weights. A continued sample's text is decoded with the
model's tokenizer when this worker can read it (`decode`), else it is null.

Streamed agent turns (`submit_streamed`): the batch's single-sample calls that the subclass can
stream (`_stream_sink`) are sent with `stream: true` and `progress(future)` reports their tokens so
far (`workers.engines.base.CheckpointableEngine`); the sink assembles the chunks into the body a
non-streamed call gets, parsed as usual. Other calls are answered whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any

import httpx
import numpy as np

from schemas.request import RolloutRequest
from workers.engines.async_bridge import AsyncBridge, run_batch
from workers.engines.base import INTERRUPTED, EngineIdentity, Finish, SampleOutput
from workers.engines.http.backends import Answer, answered
from workers.engines.http.client import Call, GenerateClient, StreamSink
from workers.errors import EngineUnavailableError

log = logging.getLogger(__name__)


class HTTPEngine(EngineIdentity):
    """The batching half of an HTTP engine; subclasses add the wire format and the lifecycle."""

    _client: GenerateClient
    model_path: str  # the served model's directory, as this worker sees it (the tokenizer, a materialised load)

    snapshots_complete = False  # `progress()` has token ids only: for streamed turns, not checkpoints

    def __init__(self, *, name: str) -> None:
        self._live: dict[Future, _LiveBatch] = {}  # streamed batches in flight: their samples so far
        self._bridge = AsyncBridge(name=name)
        self._in_flight = 0
        self._in_flight_lock = threading.Condition()
        self._interrupts = 0  # bumped by `interrupt`: aborted answers of calls started before are interrupted
        self._tokenizer: Any = None  # loaded on first `decode`, False when unreadable

    # -- what a subclass supplies ----------------------------------------------------------

    def _plan(self, request: RolloutRequest) -> list[Any]:
        """The calls that produce every sample of `request`; raise to refuse it."""
        raise NotImplementedError

    def _parse(self, call: Any, url: str, body: Any) -> list[SampleOutput]:
        """The samples of one call's answer from `url`."""
        raise NotImplementedError

    def _prepare(self, requests: Sequence[RolloutRequest]) -> None:
        """Called on the caller's thread before a batch is sent (load what it needs); nothing by default."""

    def _stream_sink(self, call: Any) -> StreamSink | None:
        """A sink for a single-sample call's streamed chunks; None: the call is answered whole."""
        return None

    # -- generation ------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Where generation goes: the URLs given."""
        return self._client.pool.urls

    @property
    def client(self) -> GenerateClient:
        return self._client

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        # All or nothing: the first bad answer cancels (and aborts) the rest of the batch.
        self._prepare(requests)
        return self._bridge.run(run_batch(requests, self._plan, self._generate))

    @property
    def capacity(self) -> int:
        return self._client.max_in_flight

    def load(self) -> int:
        """Samples submitted and not answered yet."""
        return self._in_flight

    def submit(self, requests: Sequence[RolloutRequest]) -> Future[list[list[SampleOutput]]]:
        """`generate` without waiting: the batch runs on the engine loop; cancel the future to abort it."""
        return self._submit(requests, self._generate)

    def submit_streamed(self, requests: Sequence[RolloutRequest]) -> Future[list[list[SampleOutput]]]:
        """`submit`, with the batch's tokens reported as they come (`progress`) where calls stream."""
        live = _LiveBatch(requests)
        future = self._submit(requests, lambda call: self._generate(call, live))
        self._live[future] = live
        future.add_done_callback(lambda done: self._live.pop(done, None))
        return future

    def progress(self, future: Future[list[list[SampleOutput]]]) -> list[list[SampleOutput]] | None:
        """A streamed batch's samples so far (`submit_streamed`); None for any other batch or once it
        resolved."""
        live = self._live.get(future)
        return None if live is None or future.done() else live.outputs()

    def _submit(self, requests: Sequence[RolloutRequest],
                generate: Callable[[Any], Awaitable[list[SampleOutput]]]) -> Future[list[list[SampleOutput]]]:
        self._prepare(requests)
        samples = sum(r.sampling_params.n for r in requests)
        with self._in_flight_lock:
            self._in_flight += samples
        future = asyncio.run_coroutine_threadsafe(run_batch(requests, self._plan, generate), self._bridge.loop)

        def done(_: Future) -> None:
            with self._in_flight_lock:
                self._in_flight -= samples
                self._in_flight_lock.notify_all()

        future.add_done_callback(done)
        return future

    async def _generate(self, call: Call, live: _LiveBatch | None = None) -> list[SampleOutput]:
        interrupts = self._interrupts
        sink = None
        if live is not None and getattr(call, "samples", 1) == 1 and self._stream_sink(call) is not None:
            first = getattr(call, "first_sample", 0)

            def sink() -> StreamSink:
                return _Reported(self._stream_sink(call), lambda ids: live.update(call.request, first, ids))
        url, body = await self._client.generate(call, sink)
        samples = self._parse(call, url, body)
        if self._interrupts != interrupts:  # aborted by `interrupt`: to be continued, not an abort row
            for sample in samples:
                if sample.finish.kind == "abort":
                    sample.finish = Finish("abort", message=INTERRUPTED)
        return samples

    # -- the interruptible interface (partial weight swaps) --------------------------------

    # Seconds between aborts of the calls an interrupt stops: an abort that reached the server
    # before the request did (still on its way in) finds nothing to stop, so it is sent again.
    reabort_s = 1.0

    def interrupt(self) -> int:
        """Abort this worker's calls in flight; return once every call has answered (each with
        its partial output), with the number of samples that were in flight."""
        with self._in_flight_lock:
            stopped = self._in_flight
            self._interrupts += 1
        if not stopped:
            return stopped
        targets = self._bridge.run(_sent_now(self._client))
        while True:
            answers = self._bridge.run(self._client.abort_sent(only=targets))
            failed = sorted({server for per_server in answers.values()
                             for server, answer in per_server.items() if not answered(answer)})
            if failed:
                log.warning("aborts at a partial swap not answered by %s; their samples finish first", failed)
                targets = set()
            with self._in_flight_lock:
                if self._in_flight_lock.wait_for(lambda: self._in_flight == 0,
                                                 timeout=self.reabort_s if targets else None):
                    return stopped
            targets &= self._bridge.run(_sent_now(self._client))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        """The text of `token_ids` with the model's tokenizer, if this worker can read it."""
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as exc:  # not readable from here: continued rows get no text
                log.warning("tokenizer of %s not readable here (%s); continued samples' text is null",
                            self.model_path, exc)
                self._tokenizer = False
        if self._tokenizer is False:
            return None
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # -- calls to every server -------------------------------------------------------------

    def _all_answered(self, call: str, answers: dict[str, Answer]) -> dict[str, httpx.Response]:
        """The answers if every server answered without an HTTP error; else raise naming each failure."""
        failures = [self._client.backends.describe(url, a) for url, a in answers.items() if not answered(a)]
        if failures:
            raise EngineUnavailableError(f"{self._client.wire.server} {call} failed on " + "; ".join(failures))
        return answers  # type: ignore[return-value]

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError):
            self._bridge.run(self._client.aclose())
        self._bridge.close()


class _Reported:
    """A sink whose tokens so far go to a streamed batch's samples as each chunk arrives."""

    def __init__(self, sink: Any, report: Callable[[list[int]], None]) -> None:
        self.sink = sink
        self.fields = sink.fields
        self.report = report

    def take(self, chunk: Any) -> None:
        self.sink.take(chunk)
        self.report(self.sink.so_far())

    def so_far(self) -> list[int]:
        return self.sink.so_far()

    def answer(self) -> Any:
        return self.sink.answer()


class _LiveBatch:
    """A streamed batch's samples so far, by request and sample index."""

    def __init__(self, requests: Sequence[RolloutRequest]) -> None:
        self._index = {id(r): k for k, r in enumerate(requests)}
        self._ids: list[list[list[int]]] = [[[] for _ in range(r.sampling_params.n)] for r in requests]
        self._lock = threading.Lock()

    def update(self, request: RolloutRequest, sample: int, ids: list[int]) -> None:
        with self._lock:
            self._ids[self._index[id(request)]][sample] = list(ids)

    def outputs(self) -> list[list[SampleOutput]]:
        unfinished = Finish("abort", message=INTERRUPTED)
        with self._lock:
            return [[SampleOutput(token_ids=np.asarray(ids, dtype=np.int32), finish=unfinished) for ids in samples]
                    for samples in self._ids]


async def _sent_now(client: GenerateClient) -> set[str]:
    """The client's calls in flight, read on its loop."""
    return client.sent()

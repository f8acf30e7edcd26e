"""The hf engine's concurrent, interruptible interface (`workers.engines.serial.SerialFeed`):
batches in order on the engine's thread, an interrupt ends the running one at its next step with
its tokens kept, queued ones come back empty, and a cancelled batch stops decoding."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from schemas.request import RolloutRequest
from tests.helpers.processes import wait_until
from workers.engines.hf.engine import HFEngine


def long(rid: str, **params: object) -> RolloutRequest:
    return RolloutRequest(id=rid, input_ids=[5, 6, 7],
                          sampling_params={"max_new_tokens": 200, "ignore_eos": True, "seed": 1, **params})


@pytest.fixture
def engine(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    engine = HFEngine(tiny_model_dir, max_batch_sequences=4)
    yield engine
    engine.close()


def held(engine: HFEngine, at: int) -> tuple[threading.Event, threading.Event]:
    """A forward hook that stops at forward `at` until released; (reached, release)."""
    reached, release = threading.Event(), threading.Event()
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1
        if count[0] == at:
            reached.set()
            assert release.wait(timeout=30)

    engine.model.register_forward_hook(hook)
    return reached, release


def test_interrupt_keeps_tokens_of_the_running_batch_and_empties_the_queue(engine: HFEngine) -> None:
    reached, release = held(engine, at=11)  # prefill + 10 tokens fed: 10 generated
    running = engine.submit([long("a", n=2)])
    queued = engine.submit([long("b")])
    assert engine.capacity == 4 and engine.load() == 3
    assert reached.wait(timeout=30)
    stopper = threading.Thread(target=lambda: results.append(engine.interrupt()))
    results: list[int] = []
    stopper.start()
    wait_until(lambda: queued.done(), what="the queued batch to resolve")  # before the running one ends
    release.set()
    stopper.join(timeout=30)
    assert results == [3] and engine.load() == 0
    first, second = running.result(timeout=5)[0]
    for sample in (first, second):
        assert sample.finish.interrupted and len(sample.token_ids) == 10
        assert sample.logprobs is not None and len(sample.logprobs) == 10
    assert first.token_ids.tolist() != second.token_ids.tolist()  # n=2: each sample its own seed
    ((untouched,),) = queued.result(timeout=5)
    assert untouched.finish.interrupted and len(untouched.token_ids) == 0
    # After the interrupt the engine serves as before.
    ((after,),) = engine.submit([long("c", max_new_tokens=5)]).result(timeout=30)
    assert len(after.token_ids) == 5 and after.finish.kind == "length"


def test_cancelling_a_running_batch_stops_its_decode_loop(engine: HFEngine) -> None:
    reached, release = held(engine, at=3)
    future = engine.submit([long("a", max_new_tokens=100_000)])
    assert reached.wait(timeout=30)
    assert future.cancel()  # a job timeout: the future is still pending while its batch runs
    release.set()
    wait_until(lambda: engine.load() == 0, timeout=30, what="the cancelled batch to stop")
    ((after,),) = engine.submit([long("b", max_new_tokens=3)]).result(timeout=30)
    assert len(after.token_ids) == 3

"""Partial weight swaps on a worker: samples in flight stop, the weights load without a drain, the
samples continue on the new weights, and every token keeps the version that generated it.

In-process workers on the real Redis with the sim engine; lengths are exact (a median far above
`max_new_tokens`, so every sequence runs to its `max_new_tokens`), and the sim continues a sample
along the same planned ids, so an interrupted and continued completion must equal the plan.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import redis

import pipeline
from pipeline import control
from schemas.request import RolloutRequest
from tests.helpers import wait_until
from workers.engines.sim import SimConfig, SimEngine, simulate_sample
from workers.worker import RolloutWorker

CONFIG = SimConfig(step_s=0.002, median_tokens=10_000, p99_tokens=10_001, capacity=16)


class Counting(SimEngine):
    """Notes each load's moment relative to the batches' ends."""

    def __init__(self) -> None:
        super().__init__(CONFIG)
        self.events: list[str] = []

    def submit(self, requests: Sequence[RolloutRequest]) -> Future:
        future = super().submit(requests)
        future.add_done_callback(lambda _: self.events.append("done"))
        return future

    def update_weights(self, path: str, version: int) -> None:
        self.events.append(f"load v{version}")
        super().update_weights(path, version)


def lines(prefix: str, tokens: Sequence[int], n: int = 1) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": t, "n": n, "seed": i}}
            for i, t in enumerate(tokens)]


def run_with_push(conn: redis.Redis, engine: SimEngine, mode: str, at_tokens: int = 40) -> list[dict]:
    """Run a worker; once the engine has decoded `at_tokens` steps, push v1 in `mode`."""
    acks: list = []
    errors: list[BaseException] = []

    def push() -> None:
        try:
            wait_until(lambda: engine.stats().steps > at_tokens and engine.load() > 0, what="decoding")
            acks.extend(control.push_weights(conn, "/ckpt/v1", 1, timeout=20, mode=mode).acks)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=push)
    thread.start()
    try:
        RolloutWorker(conn, engine, control_poll_s=0.05).work(burst=False, max_idle_time=2, with_scheduler=False,
                                                              logging_level="WARNING")
    finally:
        thread.join(timeout=30)
        engine.close()
    if errors:
        raise errors[0]
    return [a.model_dump() for a in acks]


def test_partial_swap_continues_samples_on_the_new_weights(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(lines("a", [300, 300, 5, 200], n=2), run="partial", output=f"file://{tmp_path}",
                          batch_size=2)
    engine = Counting()
    acks = run_with_push(redis_client, engine, "partial")
    assert [a["mode"] for a in acks] == ["partial"] and all(a["ok"] for a in acks)
    # Not drained: the load came before the long samples' batches finished.
    assert engine.events.index("load v1") < len(engine.events) - 1
    assert engine.events[-1] == "done"
    assert batch.wait(timeout=10).counts["finished"] == 2
    table = batch.read()
    assert table.num_rows == 8
    rows = {r["rollout_id"]: r for r in table.to_pylist()}
    for request in lines("a", [300, 300, 5, 200], n=2):
        parsed = RolloutRequest.model_validate(request)
        for i in range(2):
            row = rows[f"{parsed.id}:{i}"]
            plan = simulate_sample(CONFIG, parsed, i, 0)
            # Every token of the plan, once, in order: nothing lost or repeated at the boundary.
            assert row["completion_token_ids"] == plan.token_ids.tolist()
            assert row["completion_logprobs"] == plan.logprobs.tolist()  # type: ignore[union-attr]
            assert row["completion_tokens"] == parsed.sampling_params.max_new_tokens
            assert row["weight_version"] == 0
            segments = row["weight_version_segments"]
            if parsed.sampling_params.max_new_tokens == 5:
                assert segments is None  # finished before the swap: a single-version row as before
            else:
                assert segments is not None and [s["version"] for s in segments] == [0, 1]
                assert segments[0]["start"] == 0 and 0 < segments[1]["start"] < row["completion_tokens"]
    assert sorted(c.weight_version for c in batch.commits()) == [0, 0]  # the oldest version in each shard


def test_drain_swap_waits_for_the_samples_in_flight(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(lines("a", [150, 150]), run="drain", output=f"file://{tmp_path}", batch_size=2)
    engine = Counting()
    acks = run_with_push(redis_client, engine, "drain")
    assert [a["mode"] for a in acks] == ["drain"]
    assert engine.events == ["done", "load v1"]
    assert batch.wait(timeout=10).counts["finished"] == 1
    table = batch.read()
    assert table.column("weight_version").to_pylist() == [0, 0]
    assert table.column("weight_version_segments").null_count == 2
    assert np.all(table.column("completion_tokens").to_numpy() == 150)

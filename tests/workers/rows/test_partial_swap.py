"""Partial weight swaps on a worker: samples in flight stop, the weights load without a drain, the
samples continue on the new weights, and every token keeps the version that generated it.

In-process workers on the real Redis with the sim engine; lengths are exact (a median far above
`max_new_tokens`, so every sequence runs to its `max_new_tokens`), and the sim continues a sample
along the same planned ids, so an interrupted and continued completion must equal the plan.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import redis

import pipeline
from pipeline.core import adapters
from pipeline.core.broker import control_channel
from schemas.request import RolloutRequest
from tests.helpers.adapters import build_adapter, greedy_reference
from tests.helpers.models import token_id
from tests.helpers.processes import wait_until
from workers.engines.adapters.cache import read_version
from workers.engines.base import Engine
from workers.engines.hf.engine import HFEngine
from workers.engines.sim.engine import SimConfig, SimEngine, adapter_seed, simulate_sample
from workers.process.worker import RolloutWorker

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


def run_with_push(conn: redis.Redis, engine: Engine, mode: str, ready: Callable[[], bool] | None = None,
                  path: str = "/ckpt/v1", push_now: Callable[[], Sequence[Any]] | None = None,
                  **worker_options: object) -> list[dict]:
    """Run a worker; once `ready()` (default: the sim engine decoded 40 steps), push `path` as v1 in `mode`
    (or call `push_now`, which pushes and returns the acknowledgements)."""
    acks: list = []
    errors: list[BaseException] = []
    if ready is None:
        sim = engine
        assert isinstance(sim, SimEngine)
        ready = lambda: sim.stats().steps > 40 and sim.load() > 0  # noqa: E731

    def push() -> None:
        try:
            wait_until(ready, timeout=60, what="decoding")
            acks.extend(push_now() if push_now is not None else
                        control_channel.push_weights(conn, path, 1, timeout=60, mode=mode).acks)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=push)
    thread.start()
    try:
        RolloutWorker(conn, engine, control_poll_s=0.05, **worker_options).work(  # type: ignore[arg-type]
            burst=False, max_idle_time=2, with_scheduler=False, logging_level="WARNING")
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
    since: list[float] = []

    def both_jobs_decoding() -> bool:
        """Both jobs reached the engine, then 40 steps passed (the engine's idle steps before a loaded
        machine's slow worker start do not count), with the long samples still running."""
        if len(engine.submitted_at) < 2:
            return False
        since[:] = since or [engine.stats().steps]
        return engine.stats().steps - since[0] > 40 and engine.load() > 0

    acks = run_with_push(redis_client, engine, "partial", ready=both_jobs_decoding)
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


def adapter_lines(tokens: Sequence[int], adapter: str | None) -> list[dict]:
    return [{"id": f"{adapter or 'base'}{i}", "input_ids": [1, 2], "adapter": adapter,
             "sampling_params": {"max_new_tokens": t, "seed": i}} for i, t in enumerate(tokens)]


def test_partial_adapter_push_continues_its_samples_on_the_new_version(
        redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial push of adapter v2 while a job runs v1: its samples in flight stop and continue on v2
    (each token from the version the sim draws for it), a sample that had finished stays all v1,
    and a base sample in the same job is continued on the base, unchanged."""
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "v1", seed=1), base=tiny_model_dir)
    v2 = build_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    # Long enough (3 s on the sim) for the push to land while they run on a loaded machine.
    requests = adapter_lines([1500, 1500, 5], "sql") + adapter_lines([1500], None)
    batch = client.submit(requests, run="adapter-partial", output=f"file://{tmp_path}/out", batch_size=8)
    engine = SimEngine(CONFIG)
    acks = run_with_push(redis_client, engine, "partial", push_now=lambda: client.push_adapter(
        "sql", v2, base=tiny_model_dir, mode="partial").acks)
    assert [(a["adapter"], a["version"], a["mode"]) for a in acks] == [("sql", 2, "partial")]
    assert acks[0]["detail"] == "3 sample(s) stopped, 1 job(s) continued on v2"  # the 5-token one had finished
    assert batch.wait(timeout=10).counts["finished"] == 1
    rows = {r["request_id"]: r for r in batch.read().to_pylist()}
    record = client.adapters()["sql"]
    seeds = {v: adapter_seed(read_version(adapters.stored_record(record.url, "sql", v))) for v in (1, 2)}
    for request in requests:
        parsed = RolloutRequest.model_validate(request)
        row = rows[parsed.id]
        assert row["weight_version_segments"] is None and row["weight_version"] == 0  # the weights did not change
        if parsed.adapter is None:
            assert (row["adapter"], row["adapter_version"], row["adapter_version_segments"]) == (None, None, None)
            assert row["completion_token_ids"] == simulate_sample(CONFIG, parsed, 0, 0).token_ids.tolist()
            continue
        assert (row["adapter"], row["adapter_version"]) == ("sql", 1)  # the oldest of its tokens
        on = {v: simulate_sample(CONFIG, parsed, 0, 0, seeds[v]) for v in (1, 2)}
        if parsed.sampling_params.max_new_tokens == 5:  # finished before the push: all v1, no segments
            assert row["adapter_version_segments"] is None
            assert row["completion_token_ids"] == on[1].token_ids.tolist()
            continue
        segments = row["adapter_version_segments"]
        assert [s["version"] for s in segments] == [1, 2] and segments[0]["start"] == 0
        k = segments[1]["start"]
        assert 0 < k < 1500 and len(row["completion_token_ids"]) == 1500
        # Tokens before the push are v1's draws, after it v2's: each token from the version it names.
        expected = on[1].token_ids[:k].tolist() + on[2].token_ids[k:].tolist()
        assert row["completion_token_ids"] == expected
        assert row["completion_logprobs"] == on[1].logprobs[:k].tolist() + on[2].logprobs[k:].tolist()  # type: ignore[index]
        assert on[1].token_ids[k:].tolist() != on[2].token_ids[k:].tolist()  # the versions do differ there


def test_a_partial_adapter_push_to_a_worker_that_cannot_interrupt_lets_the_job_finish_and_says_so(
        redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "v1", seed=1), base=tiny_model_dir)
    v2 = build_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    batch = client.submit(adapter_lines([1500], "sql"), run="no-interrupt", output=f"file://{tmp_path}/out")
    acks = run_with_push(redis_client, SimEngine(CONFIG), "partial", feed=False, push_now=lambda: client.push_adapter(
        "sql", v2, base=tiny_model_dir, mode="partial").acks)  # one batch at a time: no interrupt
    assert [(a["mode"], a["detail"]) for a in acks] == [
        ("drain", "the sim engine cannot stop samples in flight: 1 job(s) finish on the version they pinned")]
    assert batch.wait(timeout=10).counts["finished"] == 1
    (row,) = batch.read().to_pylist()
    assert (row["adapter_version"], row["adapter_version_segments"]) == (1, None)


def test_a_worker_that_cannot_interrupt_drains_and_says_so(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(lines("a", [150, 150]), run="nofeed", output=f"file://{tmp_path}", batch_size=2)
    engine = Counting()
    acks = run_with_push(redis_client, engine, "partial", feed=False)  # one batch at a time: no interrupt
    assert [a["mode"] for a in acks] == ["drain"]
    assert engine.events == ["done", "load v1"]
    assert batch.wait(timeout=10).counts["finished"] == 1
    assert batch.read().column("weight_version").to_pylist() == [0, 0]


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


def teacher_forced_logprobs(model_dir: Path, prompt: list[int], completion: list[int],
                            temperature: float) -> list[float]:
    """The logprob of every completion token, recomputed in one forward over prompt + completion."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits if temperature < 1e-6 else logits / temperature
    lp = torch.log_softmax(scaled[len(prompt) - 1 : len(prompt) + len(completion) - 1], dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


class CountingHF(HFEngine):
    """Counts forward passes; the `hold_at`th waits for the interrupt, so the swap lands mid-decode
    (after `hold_at - 1` tokens of every sample)."""

    def __init__(self, *args: object, hold_at: int = 20, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.forwards = 0
        self.hold_at = hold_at
        self.interrupting = threading.Event()

    def _count(self, *_: object) -> None:
        self.forwards += 1
        if self.forwards == self.hold_at:
            assert self.interrupting.wait(timeout=60), "no interrupt came"

    def _run_batch(self, requests, stop):  # type: ignore[no-untyped-def]
        handle = self.model.register_forward_hook(self._count)
        try:
            return super()._run_batch(requests, stop)
        finally:
            handle.remove()

    def interrupt(self) -> int:
        self.interrupting.set()
        return super().interrupt()


def test_hf_partial_swap_logprobs_are_each_tokens_version(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, v1_model_dir: Path
) -> None:
    """Two weight files: every stored logprob equals a teacher-forced recomputation under the version
    recorded for its token, and each row's version changes exactly once, at the boundary."""
    client = pipeline.Client(redis_client)
    requests = [
        {"id": "sampled", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 120, "n": 2, "seed": 3,
                                                                       "ignore_eos": True}},
        {"id": "greedy", "input_ids": [9, 8], "sampling_params": {"max_new_tokens": 120, "temperature": 0,
                                                                   "ignore_eos": True}},
        {"id": "warm", "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 120, "temperature": 0.7,
                                                                       "top_k": 20, "seed": 5, "ignore_eos": True}},
    ]
    batch = client.submit(requests, run="hf-partial", output=f"file://{tmp_path}", batch_size=8)
    engine = CountingHF(tiny_model_dir)
    acks = run_with_push(redis_client, engine, "partial", ready=lambda: engine.forwards >= 20,
                         path=str(v1_model_dir))
    assert [a["mode"] for a in acks] == ["partial"] and all(a["ok"] for a in acks)
    assert batch.wait(timeout=30).counts["finished"] == 1
    rows = batch.read().to_pylist()
    assert len(rows) == 4
    models = {0: tiny_model_dir, 1: v1_model_dir}
    for row in rows:
        completion, stored = row["completion_token_ids"], row["completion_logprobs"]
        assert len(completion) == 120  # max_new_tokens counts the whole completion
        segments = row["weight_version_segments"]
        assert segments is not None and [s["version"] for s in segments] == [0, 1]  # exactly one change
        boundary = segments[1]["start"]
        assert 0 < boundary < 120 and row["weight_version"] == 0
        versions = [0] * boundary + [1] * (120 - boundary)
        for version, model_dir in models.items():
            expected = teacher_forced_logprobs(model_dir, row["prompt_token_ids"], completion, row["temperature"])
            mine = [i for i, v in enumerate(versions) if v == version]
            assert np.allclose([stored[i] for i in mine], [expected[i] for i in mine], atol=1e-3), (row["rollout_id"],
                                                                                                     version)
        # And the two versions really differ on these tokens (the check could not pass by accident).
        other = teacher_forced_logprobs(tiny_model_dir, row["prompt_token_ids"], completion, row["temperature"])
        assert not np.allclose(stored[boundary:], other[boundary:], atol=1e-3)
    sampled = [r for r in rows if r["request_id"] == "sampled"]
    assert sampled[0]["completion_token_ids"] != sampled[1]["completion_token_ids"]  # n=2 keep distinct seeds


def test_hf_partial_adapter_push_each_token_checked_under_its_adapter_version(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hf engine (peft) across a partial push of adapter v2: a greedy row's tokens are v1's greedy
    tokens up to the boundary and v2's greedy continuation after it, each recomputed by peft alone;
    `pipeline verify` checks every token under base + its own adapter version, and flags the same
    rows once their adapter segments are dropped (so it cannot pass by checking all under v1)."""
    import pyarrow.parquet as pq

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client)
    dirs = {v: build_adapter(tiny_model_dir, tmp_path / f"sql{v}", seed=v) for v in (1, 2)}
    client.push_adapter("sql", dirs[1], base=tiny_model_dir)
    tokens = 40
    requests = [
        {"id": "greedy", "input_ids": [9, 8], "adapter": "sql",
         "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}},
        {"id": "sampled", "input_ids": [5, 6, 7], "adapter": "sql",
         "sampling_params": {"max_new_tokens": tokens, "temperature": 0.8, "seed": 3, "ignore_eos": True}},
        {"id": "base", "input_ids": [1, 2, 3, 4],
         "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}},
    ]
    batch = client.submit(requests, run="hf-adapter-partial", output=f"file://{tmp_path}/out", batch_size=8)
    engine = CountingHF(tiny_model_dir)
    acks = run_with_push(redis_client, engine, "partial", ready=lambda: engine.forwards >= 20, push_now=lambda:
                         client.push_adapter("sql", dirs[2], base=tiny_model_dir, mode="partial").acks)
    assert [(a["version"], a["mode"]) for a in acks] == [(2, "partial")]
    assert batch.wait(timeout=30).counts["finished"] == 1
    rows = {r["request_id"]: r for r in batch.read().to_pylist()}
    for rid in ("greedy", "sampled"):
        segments = rows[rid]["adapter_version_segments"]
        assert [s["version"] for s in segments] == [1, 2] and rows[rid]["adapter_version"] == 1
        assert 0 < segments[1]["start"] < tokens
    greedy = rows["greedy"]
    k = greedy["adapter_version_segments"][1]["start"]
    prompt, completion = greedy["prompt_token_ids"], greedy["completion_token_ids"]
    assert completion[:k] == greedy_reference(tiny_model_dir, dirs[1], prompt, k)
    assert completion[k:] == greedy_reference(tiny_model_dir, dirs[2], prompt + completion[:k], tokens - k)
    assert rows["base"]["adapter_version_segments"] is None and rows["base"]["adapter"] is None
    assert rows["base"]["completion_token_ids"] == greedy_reference(tiny_model_dir, None, [1, 2, 3, 4], tokens)

    report = pipeline.verify("hf-adapter-partial", str(tiny_model_dir), conn=redis_client)
    assert report.tokens == 3 * tokens and report.max_abs_diff < 1e-3
    table = batch.read()
    dropped = table.set_column(table.schema.get_field_index("adapter_version_segments"), "adapter_version_segments",
                               pa.nulls(table.num_rows, table.schema.field("adapter_version_segments").type))
    (tmp_path / "dropped").mkdir()
    pq.write_table(dropped, tmp_path / "dropped" / "rows.parquet")
    assert pipeline.verify(str(tmp_path / "dropped"), str(tiny_model_dir)).max_abs_diff > 0.05


def test_hf_partial_swap_routed_experts_are_the_last_segments_for_every_position(
    redis_client: redis.Redis, tmp_path: Path, tiny_moe_dir: Path
) -> None:
    """A continued MoE sample stores the routing of its last version, recomputed by the
    continuation's prefill for every earlier position: equal to a teacher-forced routing of the
    whole sequence under v1 (and not under v0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import build_random_moe_model

    v1_dir = build_random_moe_model(tmp_path / "moe-v1", seed=1)
    client = pipeline.Client(redis_client)
    batch = client.submit([{"id": "m", "input_ids": [5, 6, 7], "return_routed_experts": True,
                            "sampling_params": {"max_new_tokens": 60, "seed": 2, "ignore_eos": True}}],
                          run="moe-partial", output=f"file://{tmp_path}/out")
    engine = CountingHF(tiny_moe_dir)
    run_with_push(redis_client, engine, "partial", ready=lambda: engine.forwards >= 20, path=str(v1_dir))
    assert batch.wait(timeout=30).counts["finished"] == 1
    (row,) = batch.read().to_pylist()
    segments = row["weight_version_segments"]
    assert segments is not None and [s["version"] for s in segments] == [0, 1]
    sequence = row["prompt_token_ids"] + row["completion_token_ids"][:-1]  # every position fed to the engine
    stored = np.asarray(row["routed_experts"]).reshape(row["routed_experts_shape"])
    assert stored.shape[0] == len(sequence) and row["routed_experts_start"] == 0

    def routing(model_dir: Path) -> np.ndarray:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([sequence]), output_router_logits=True)
        k = stored.shape[2]
        ids = [torch.topk(logits.float(), k, dim=-1).indices for logits in out.router_logits]
        return np.sort(torch.stack(ids, dim=1).numpy(), axis=-1)

    assert np.array_equal(stored, routing(v1_dir))
    assert not np.array_equal(stored, routing(tiny_moe_dir))


LOADING_KEY = "test:partial-swap:loading"
STEPS_KEY = "test:partial-swap:steps"


class LoadsForever(SimEngine):
    """A sim engine whose weight load never ends: it notes in Redis that it started (and how many
    sequences the engine still held then), so that a test can kill it in the middle of the swap."""

    def __init__(self, conn: redis.Redis, config: SimConfig) -> None:
        super().__init__(config)
        self.conn = conn
        threading.Thread(target=self._note_steps, daemon=True).start()

    def _note_steps(self) -> None:
        """The decode steps taken so far, in Redis (the test pushes once the samples have tokens)."""
        while True:
            self.conn.set(STEPS_KEY, self.stats().steps)
            time.sleep(0.02)

    def update_weights(self, path: str, version: int) -> None:
        self.conn.set(LOADING_KEY, self.load())
        threading.Event().wait()


def _serve(url: str, step_s: float, hold_swap: bool = False) -> None:
    from pipeline.core.broker.connection import connect_redis

    conn = connect_redis(url)
    config = SimConfig(capacity=16, step_s=step_s, median_tokens=10_000, p99_tokens=10_001)
    engine = LoadsForever(conn, config) if hold_swap else SimEngine(config)
    RolloutWorker(conn, engine, heartbeat_interval_s=0.5, maintenance_interval_s=1,
                  control_poll_s=0.2).work(burst=False, with_scheduler=False, logging_level="WARNING")


def test_worker_killed_mid_partial_swap_loses_and_duplicates_nothing(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL while the worker is inside a partial swap (its samples stopped, the new weights
    loading, no continuation submitted): another worker finishes every sample, once — those the
    swap's checkpoint saved continued from there on v1 (`workers.jobs.checkpoint`), the rest from
    their prompts."""
    import multiprocessing as mp
    import os
    import signal

    from pipeline.core.broker import commit_log, keys, registry

    client = pipeline.Client(redis_client)
    batch = client.submit(lines("k", [400, 400, 400, 400], n=2), run="killed", output=f"file://{tmp_path}",
                          batch_size=2)
    fork = mp.get_context("fork")
    # 0.05 s steps: the jobs (400 tokens) would take 20 s, far longer than the push takes to arrive.
    victim = fork.Process(target=_serve, args=(redis_url, 0.05, True), daemon=True)
    victim.start()
    rescuer = None
    push = threading.Thread(target=lambda: _push_ignoring_acks(client), daemon=True)
    try:
        wait_until(lambda: sum(1 for w in registry.live_workers(redis_client) if w.state == "busy") == 1, 120,
                   "the victim to start its jobs")
        # Samples with tokens to save (on a loaded machine the push could otherwise beat the first step).
        wait_until(lambda: float(redis_client.get(STEPS_KEY) or 0) >= 5, 120, "the victim's first decode steps")
        push.start()
        wait_until(lambda: redis_client.exists(LOADING_KEY), 120, "the victim to be loading v1 mid-swap")
        assert int(redis_client.get(LOADING_KEY)) == 0  # type: ignore[arg-type]  # its samples were stopped first
        wait_until(lambda: redis_client.keys(keys.checkpoint("*")), 120, "the swap's checkpoint")
        os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
        victim.join()
        assert commit_log.read_all(redis_client, "killed") == []  # nothing was written before the kill
        rescuer = fork.Process(target=_serve, args=(redis_url, 0.0), daemon=True)
        rescuer.start()
        assert batch.wait(timeout=120).counts["finished"] == 2
    finally:
        for process in (victim, rescuer):
            if process is not None and process.is_alive():
                os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                process.join()
        if push.ident is not None:
            push.join(timeout=60)
    commits = commit_log.read_all(redis_client, "killed")
    assert sorted(c.job_id for c in commits) == sorted(batch.job_ids)  # one commit per job
    assert sorted(p.name for p in tmp_path.joinpath("killed").glob("*.parquet")) == sorted(
        f"{j}.parquet" for j in batch.job_ids)
    table = batch.read()
    ids = table.column("rollout_id").to_pylist()
    assert sorted(ids) == sorted(f"k{i}:{s}" for i in range(4) for s in range(2))  # none lost, none twice
    resumed = 0
    for row in table.to_pylist():
        assert row["completion_tokens"] == 400
        if row["resumed_at"] is None:  # regenerated from the start on the rescuer, at the version it serves
            assert row["weight_version"] == 1 and row["weight_version_segments"] is None
            continue
        resumed += 1  # the v0 tokens the swap saved, then the rescuer's on v1, each once
        (kept,) = row["resumed_at"]
        assert [(s["start"], s["version"]) for s in row["weight_version_segments"]] == [(0, 0), (kept, 1)]
        request = RolloutRequest.model_validate(lines("k", [400] * 4, n=2)[int(row["request_id"][1:])])
        plan = simulate_sample(SimConfig(median_tokens=10_000, p99_tokens=10_001), request, row["sample_index"], 0)
        assert row["completion_token_ids"] == plan.token_ids.tolist()  # the sim continues its planned sample
    assert resumed


def _push_ignoring_acks(client: pipeline.Client) -> None:
    """Push v1 in partial mode; the victim never acknowledges (it dies loading), so the push's
    answer is not what the test is about."""
    with contextlib.suppress(pipeline.PipelineError):
        client.push_weights("/ckpt/v1", version=1, mode="partial", timeout=10)


def test_staleness_bound_restarts_samples_behind_the_pushed_version(redis_client: redis.Redis,
                                                                    tmp_path: Path) -> None:
    """`max_staleness=0`: nothing committed may hold a v0 token once v1 is served, so the samples
    in flight restart on v1 and so do the ones that finished on v0 before the swap."""
    client = pipeline.Client(redis_client)
    batch = client.submit(lines("s", [300, 5]), run="stale", output=f"file://{tmp_path}", batch_size=2,
                          max_staleness=0)
    engine = Counting()
    run_with_push(redis_client, engine, "partial")
    assert batch.wait(timeout=10).counts["finished"] == 1
    table = batch.read()
    assert table.column("weight_version").to_pylist() == [1, 1]
    assert table.column("weight_version_segments").null_count == 2
    assert table.column("completion_tokens").to_pylist() == [300, 5]
    from rq.job import Job
    from rq.serializers import JSONSerializer

    result = Job.fetch(batch.job_ids[0], connection=redis_client, serializer=JSONSerializer).return_value()
    assert result["restarted"] == 2 and result["continued"] >= 2


def test_hf_stop_string_straddling_the_swap_stops_the_sample(
    redis_client: redis.Redis, tmp_path: Path, scripted_model_dir: Path
) -> None:
    """The scripted model repeats "!". Interrupted after "!!", the continuation begins with "!":
    the stop "!!!" straddles the boundary and must stop the sample at its third token, as without
    a swap (the continuation alone would see "!!!" only at its own third token, five in all)."""
    client = pipeline.Client(redis_client)
    bang = [{"id": "bang", "input_ids": [token_id("!")],
             "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": "!!!"}}]
    batch = client.submit(bang, run="straddle", output=f"file://{tmp_path}")
    engine = CountingHF(scripted_model_dir, hold_at=3)  # prefill, then two tokens fed: "!!" generated
    run_with_push(redis_client, engine, "partial", ready=lambda: engine.forwards >= 3,
                  path=str(scripted_model_dir))
    assert batch.wait(timeout=30).counts["finished"] == 1
    (row,) = batch.read().to_pylist()
    assert row["completion_token_ids"] == [token_id("!")] * 3
    assert row["finish_reason"] == "stop" and row["stop_reason_text"] == "!!!"
    assert row["completion_text"] == ""  # trimmed before the stop string, as usual
    assert row["weight_version_segments"] == [{"start": 0, "version": 0}, {"start": 2, "version": 1}]
    assert len(row["completion_logprobs"]) == 3


def test_penalised_samples_restart_on_the_new_weights(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    requests = [{"id": "p", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300, "seed": 1,
                                                                     "repetition_penalty": 1.1}},
                {"id": "q", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300, "seed": 2}}]
    batch = client.submit(requests, run="penalised", output=f"file://{tmp_path}", batch_size=2)
    run_with_push(redis_client, Counting(), "partial")
    assert batch.wait(timeout=10).counts["finished"] == 1
    rows = {r["request_id"]: r for r in batch.read().to_pylist()}
    # Penalties cannot continue exactly: generated again from the prompt, all on v1.
    assert rows["p"]["weight_version"] == 1 and rows["p"]["weight_version_segments"] is None
    assert rows["p"]["completion_tokens"] == 300
    assert [s["version"] for s in rows["q"]["weight_version_segments"]] == [0, 1]  # the other continues


def test_sglang_http_partial_swap_aborts_in_flight_and_continues_on_the_new_weights(
    redis_client: redis.Redis, tmp_path: Path, scripted_model_dir: Path
) -> None:
    """Over SGLang's native protocol (a stand-in server): the interrupt is `/abort_request` with
    the rid of each request in flight, whose answers come back as interrupted samples; the continuation (its own rid,
    `{id}+{tokens before}-...`) runs after the load and the row is of the new version."""
    from tests.helpers.models import CHARS
    from tests.workers.engines.conftest import launch, stop, wait_ready
    from workers.engines.sglang.http_engine import SGLangHTTPEngine

    standin = launch(scripted_model_dir, tmp_path / "standin.log")
    try:
        wait_ready(standin)
        standin.faults(delays={"slow-": 120})  # the first call waits (abortable); the continuation does not
        client = pipeline.Client(redis_client)
        prompt = [CHARS.index(c) + 1 for c in "ab"]
        batch = client.submit([{"id": "slow", "input_ids": prompt,
                                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}],
                              run="sglang-partial", output=f"file://{tmp_path}/out")
        engine = SGLangHTTPEngine([standin.url])
        acks = run_with_push(redis_client, engine, "partial", ready=lambda: standin.stats()["generate"] >= 1,
                             path=str(scripted_model_dir))
        assert [a["mode"] for a in acks] == ["partial"]
        assert batch.wait(timeout=30).counts["finished"] == 1
        stats = standin.stats()
    finally:
        stop(standin)
    assert stats["abort_requests"] == [{"rid": stats["rids"][0]}]  # its own request, by rid
    assert stats["answered_aborted"] == 1
    assert [r.split("-")[0] for r in stats["rids"]] == ["slow", "slow+0"]
    (row,) = batch.read().to_pylist()
    # Aborted before its first token: generated again on v1, a single-version row.
    assert row["weight_version"] == 1 and row["weight_version_segments"] is None
    assert row["completion_text"] == "cde" and row["finish_reason"] == "stop"


def test_cli_partial_push_to_a_worker_process_reports_each_workers_mode(
    redis_client: redis.Redis, start_worker: Callable[..., object], pipeline_env: dict[str, str],
    v1_model_dir: Path,
) -> None:
    import subprocess

    from pipeline.core.broker import registry
    from tests.conftest import PIPELINE

    start_worker()
    wait_until(lambda: len(registry.live_workers(redis_client)) == 1, 60, "the worker to register")
    push = subprocess.run([*PIPELINE, "weights", "push", str(v1_model_dir), "--version", "1", "--mode", "partial",
                           "--timeout", "60"], env=pipeline_env, capture_output=True, text=True, timeout=90)
    assert push.returncode == 0, push.stdout + push.stderr
    assert f"weights v1 from {v1_model_dir} (partial): 1 worker(s) acknowledged" in push.stdout
    assert push.stdout.rstrip().endswith(", partial)")  # the hf worker stopped nothing and loaded without a drain
    wrong = subprocess.run([*PIPELINE, "weights", "push", str(v1_model_dir), "--version", "2", "--mode", "eager"],
                           env=pipeline_env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "invalid choice: 'eager'" in wrong.stderr

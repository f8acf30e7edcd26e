"""The sim engine: deterministic outputs, lognormal lengths, slots, utilisation, cancellation."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import numpy as np
import pytest

from schemas.request import RolloutRequest
from workers.engines.base import is_concurrent
from workers.engines.factory import EngineOptions, build_engine
from workers.engines.sim.engine import SimConfig, SimEngine, SimStats, simulate_sample
from workers.rows.table import RowContext, build_table


def _requests(count: int, max_new_tokens: int = 10_000, **extra: object) -> list[RolloutRequest]:
    return [RolloutRequest(id=f"r{i}", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": max_new_tokens},
                           **extra) for i in range(count)]


def test_outputs_are_deterministic_from_the_seed() -> None:
    [request] = _requests(1, logprobs=0)
    a = simulate_sample(SimConfig(seed=1), request, 0, 0)
    b = simulate_sample(SimConfig(seed=1), request, 0, 0)
    c = simulate_sample(SimConfig(seed=2), request, 0, 0)
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.token_ids, c.token_ids)
    assert a.token_ids.dtype == np.int32 and a.logprobs.dtype == np.float32
    assert len(a.logprobs) == len(a.token_ids) and (a.logprobs <= 0).all()


def test_lengths_follow_the_configured_lognormal() -> None:
    config = SimConfig(median_tokens=300, p99_tokens=4000)
    lengths = [len(simulate_sample(config, r, 0, 0).token_ids) for r in _requests(3000)]
    assert 270 < np.median(lengths) < 330
    assert 3000 < np.percentile(lengths, 99) < 5300


def test_finishes_by_length_or_on_a_stop_id() -> None:
    config = SimConfig(median_tokens=20, p99_tokens=40, eos_token_id=7)
    short = simulate_sample(config, _requests(1, max_new_tokens=2)[0], 0, 0)
    assert len(short.token_ids) == 2 and short.finish.kind == "length"
    request = RolloutRequest(id="s", input_ids=[1], sampling_params={"max_new_tokens": 1000, "stop": [42]})
    stopped = simulate_sample(config, request, 0, 0)
    assert stopped.finish.kind == "stop" and stopped.finish.matched == 42 and stopped.token_ids[-1] == 42
    eos = simulate_sample(config, _requests(1)[0], 0, 0)
    assert eos.finish.matched == 7 and eos.token_ids[-1] == 7


def test_outputs_pass_the_row_contracts() -> None:
    engine = SimEngine(SimConfig(max_top_logprobs=2, median_tokens=5, p99_tokens=20))
    requests = [
        RolloutRequest(id="a", input_ids=[1, 2], sampling_params={"n": 3, "max_new_tokens": 8, "stop": [5]}),
        RolloutRequest(id="b", input_ids=[3], logprobs=2, prompt_logprobs=0),
    ]
    outputs = engine.generate(requests)
    now = datetime.now(UTC)
    table = build_table(requests, outputs, RowContext("run", "job", "sim", "m", "w", 0, now, now, now))
    assert table.num_rows == 4
    rows = table.to_pylist()
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in rows)
    assert rows[3]["prompt_logprobs"][0] is None and len(rows[3]["completion_top_logprobs"][0]) == 2


def test_slots_fifo_and_utilisation() -> None:
    engine = SimEngine(SimConfig(capacity=4, step_s=0.001, median_tokens=1000, p99_tokens=1001,
                                 prefill_tokens_per_s=0))  # decode slots only; prefill is tested below
    try:
        assert is_concurrent(engine)
        done: dict[str, float] = {}
        futures = []
        at_end: list[SimStats] = []
        for i in range(2):  # 8 sequences of 40 steps on 4 slots: two waves
            future = engine.submit(_requests(4, max_new_tokens=40))
            future.add_done_callback(lambda _, i=i: done.setdefault(f"wave{i}", time.monotonic()))
            futures.append(future)
        # The stats as the last sequence ends (no idle tail after it, however slow the machine).
        futures[1].add_done_callback(lambda _: at_end.append(engine.stats()))
        assert engine.load() == 8
        for future in futures:
            assert len(future.result(timeout=10)) == 4
        assert done["wave0"] < done["wave1"]
        [stats] = at_end
        assert stats.busy_slot_steps == pytest.approx(8 * 40, rel=0.01)  # every slot-step of the two waves
        assert stats.steps >= 80 - 1e-6  # the waves ran one after the other
        # Utilisation is busy over capacity slot-steps, idle steps counted at full capacity.
        assert stats.capacity_slot_steps == pytest.approx(4 * stats.steps)
        assert stats.utilisation == pytest.approx(8 * 40 / (4 * stats.steps), rel=0.01)
        assert engine.load() == 0
    finally:
        engine.close()


def test_cancel_frees_the_slots() -> None:
    engine = SimEngine(SimConfig(capacity=2, step_s=0.01, median_tokens=1000, p99_tokens=1001))
    try:
        future = engine.submit(_requests(3, max_new_tokens=1000))
        assert future.cancel()
        time.sleep(0.05)
        assert engine.load() == 0
        assert len(engine.submit(_requests(1, max_new_tokens=3)).result(timeout=5)) == 1
    finally:
        engine.close()


def test_built_from_the_command_line_options() -> None:
    engine = build_engine(EngineOptions(engine="sim", sim={"capacity": 8, "step_s": 0.0}))
    assert engine.description.name == "sim" and engine.capacity == 8  # type: ignore[attr-defined]
    assert len(engine.generate(_requests(2, max_new_tokens=4))) == 2
    engine.update_weights("/any", 3)
    assert engine.weight_version == 3
    engine.close()


def test_a_turn_that_extends_the_last_one_finds_its_prefix_cached_until_a_weight_swap() -> None:
    engine = SimEngine(SimConfig(median_tokens=20, p99_tokens=21, block_tokens=4))
    try:
        first = RolloutRequest(id="t1", input_ids=list(range(1, 41)), sampling_params={"max_new_tokens": 20})
        [[one]] = engine.generate([first])
        assert one.cached_tokens == 0
        # Turn 2 replays turn 1's prompt and completion, then a tool result.
        history = [*first.input_ids, *one.token_ids.tolist(), *range(500, 530)]
        second = RolloutRequest(id="t2", input_ids=history, sampling_params={"max_new_tokens": 20})
        [[two]] = engine.generate([second])
        context = len(first.input_ids) + len(one.token_ids)
        assert two.cached_tokens == context // 4 * 4  # every full block of turn 1's context
        stats = engine.stats()
        assert stats.cached_tokens == two.cached_tokens
        assert stats.prefill_tokens == len(first.input_ids) + len(history) - two.cached_tokens
        engine.update_weights("/new", 1)  # the old weights' cache is no use to the new ones
        third = RolloutRequest(id="t3", input_ids=history, sampling_params={"max_new_tokens": 20})
        [[three]] = engine.generate([third])
        assert three.cached_tokens == 0 and three.weight_version == 1
    finally:
        engine.close()


def test_prefill_stalls_the_engine_for_the_uncached_context() -> None:
    # 20 000 uncached tokens at 100 000 tokens/s: 0.2 s in which nothing decodes.
    engine = SimEngine(SimConfig(capacity=4, step_s=0.001, median_tokens=1000, p99_tokens=1001,
                                 prefill_tokens_per_s=100_000, prefix_cache_tokens=0))
    try:
        long = RolloutRequest(id="long", input_ids=[5] * 20_000, sampling_params={"max_new_tokens": 2})
        engine.generate([long])
        stats = engine.stats()
        assert stats.prefill_tokens == 20_000
        assert stats.prefill_s == 0.2
        # The stall counts as idle capacity: utilisation cannot reach the decode-only figure.
        assert stats.busy_slot_steps <= 2 + 1e-6 and stats.capacity_slot_steps >= 0.2 / 0.001 * 4 * 0.99
    finally:
        engine.close()


def test_progress_reports_each_sample_so_far_without_stopping_it() -> None:
    """`progress()` (a worker's checkpoint): finished samples whole, running ones a prefix of their
    plan (interrupted), the batch running on; None once it resolved."""
    from tests.helpers.processes import wait_until
    from workers.engines.base import is_checkpointable

    config = SimConfig(capacity=4, step_s=0.002, median_tokens=10_000, p99_tokens=10_001)
    engine = SimEngine(config)
    try:
        assert is_checkpointable(engine)
        requests = [RolloutRequest(id="short", input_ids=[1], sampling_params={"max_new_tokens": 3, "seed": 1}),
                    RolloutRequest(id="long", input_ids=[1], sampling_params={"max_new_tokens": 400, "seed": 2})]
        future = engine.submit(requests)
        wait_until(lambda: len((engine.progress(future) or [[], [None]])[1][0].token_ids) >= 10, 30, "decoding")
        short, long = (samples[0] for samples in engine.progress(future) or [])
        plan = [simulate_sample(config, r, 0, 0) for r in requests]
        assert short.finish == plan[0].finish and short.token_ids.tolist() == plan[0].token_ids.tolist()
        assert long.finish.interrupted and 10 <= len(long.token_ids) < 400
        assert long.token_ids.tolist() == plan[1].token_ids[: len(long.token_ids)].tolist()
        assert not future.done()  # a snapshot: the batch runs on
        assert len(future.result(timeout=30)[1][0].token_ids) == 400
        assert engine.progress(future) is None
    finally:
        engine.close()

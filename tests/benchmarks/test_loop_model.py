"""The loop model (`benchmarks/loop_model.py`) on loops small enough to work out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.loop_model import LoopConfig, simulate, synchronous

# One slot, every sample 10 tokens at 10 ms a token, free prefill, 50 ms loads, one sample a step.
ONE_SLOT = LoopConfig(slots=1, step_s=0.01, prefill_tokens_per_s=0, lengths=(10,), steps=3, samples=1, load_s=0.05)


def test_the_synchronous_loop_with_one_slot() -> None:
    # Each step: 0.1 s decoding, no training time, then a 0.05 s load: busy 0.1 of every 0.15 s.
    result = simulate(synchronous(ONE_SLOT))
    assert result.seconds == pytest.approx(0.45)
    assert result.busy == pytest.approx(0.1 / 0.15)
    assert result.samples_per_s == pytest.approx(3 / 0.45)
    assert result.max_lag == 0 and result.mixed_rows == 0


def test_training_time_is_idle_time_in_the_synchronous_loop() -> None:
    # train_fraction 1: the trainer takes as long as the engine took for the step at full occupancy (0.1 s).
    result = simulate(synchronous(replace(ONE_SLOT, train_fraction=1.0)))
    assert result.seconds == pytest.approx(3 * 0.25)
    assert result.busy == pytest.approx(0.3 / 0.75)
    assert result.idle_reasons["trainer"] == pytest.approx(0.3 / 0.75)
    assert result.idle_reasons["swap"] == pytest.approx(0.15 / 0.75)


def test_prefill_stalls_the_engine() -> None:
    # A 100-token prompt at 1 000 tokens/s: 0.1 s before each sample decodes; loads free.
    result = simulate(synchronous(replace(ONE_SLOT, prefill_tokens_per_s=1000, prompt_tokens=100, load_s=0.0)))
    assert result.seconds == pytest.approx(3 * 0.2)
    assert result.busy == pytest.approx(0.5)
    assert result.idle_reasons["prefill"] == pytest.approx(0.5)


def test_generating_one_step_ahead_overlaps_the_trainer() -> None:
    # K = 1 with training as long as a step's generation: the engine decodes the next step's sample
    # while the trainer trains, so it idles only for the loads; the synchronous loop idles for both.
    config = replace(ONE_SLOT, steps=6, train_fraction=1.0, load_s=0.01)
    ahead = simulate(replace(config, max_staleness=1, mode="partial", policy="in_order"))
    sync = simulate(synchronous(config))
    assert ahead.busy > 0.85 > 0.5 > sync.busy
    assert ahead.samples_per_s > 1.5 * sync.samples_per_s  # 0.11 s a step against 0.21, less the first step
    assert ahead.max_lag == 1


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("policy", ["in_order", "first_finished"])
def test_no_trained_sample_is_older_than_the_bound(k: int, policy: str) -> None:
    config = LoopConfig(slots=32, samples=64, steps=8, max_new_tokens=2048, max_staleness=k, policy=policy,
                        train_fraction=0.5)
    for mode in ("partial", "drain"):
        result = simulate(replace(config, mode=mode))
        assert result.max_lag <= k
        assert result.samples_per_s == pytest.approx(8 * 64 / result.seconds)


def test_a_partial_swap_pays_the_prefill_of_what_it_interrupts() -> None:
    # One 100-token sample a step, K = 1, the trainer as quick as can be: the next step's sample is
    # mid-way when the push lands; with prefill paid it continues after re-computing its context.
    config = replace(ONE_SLOT, lengths=(100,), steps=4, max_staleness=1, mode="partial", policy="in_order",
                     prompt_tokens=10)
    free = simulate(config)
    paid = simulate(replace(config, prefill_tokens_per_s=1000))
    assert paid.seconds > free.seconds and paid.idle_reasons["prefill"] > 0 == free.idle_reasons["prefill"]
    assert paid.mixed_rows == free.mixed_rows > 0


def test_the_model_is_deterministic() -> None:
    config = LoopConfig(steps=3, samples=128)
    assert simulate(config) == simulate(config)

"""A discrete-event model of an RL loop's engine and trainer: how busy the engine stays, and why not.

    .venv/bin/python benchmarks/loop_model.py [--steps 10] [--samples 512] [--cap 4096 16384]
        [--train-fraction 0 0.5] [--max-staleness 1 2 4]

Deterministic (a seed draws the output lengths), a fraction of a second per loop, and blind to the
machine it runs on: the figures are the model's, not a measurement.

The engine: `slots` sequences decode together, one token each per `step_s`; a sequence entering
the engine first has its context prefilled at `prefill_tokens_per_s`, during which nothing decodes
(as `workers.engines.sim.engine` does); a job of `job_size` samples commits, and reaches the trainer,
when its last sample finishes. Output lengths are lognormal (median, p99), capped at
`max_new_tokens`. A weight load pauses the engine for `load_s`; in `partial` mode the sequences in
flight then continue on the new weights and pay the prefill of their prompt and every token so
far (the prefix cache does not survive a swap); in `drain` mode the engine admits nothing new
and loads once every sequence in flight has finished.

The trainer: step v trains on `samples` finished samples and takes `train_s` (`train_fraction`
x the time the engine needs for a step's samples at full occupancy), then pushes (`push_s`,
trainer side) and the engine loads the next version. Work is admitted by staleness (AReaL's rule,
counted in steps): the samples of step s start once the engine serves a version >= s - K
(`max_staleness`), so K = 0 is the synchronous loop (generate, drain, train, push, repeat) and
K >= 1 generates up to K steps ahead while the trainer trains. Step v trains on its own samples
(`in_order`: their longest is the step's tail), or (`first_finished`) on whichever samples have
finished, oldest version first, where every sample that would otherwise exceed the bound is
waited for, or (`unbounded`, `benchmarks/rl_loop.py`'s trainer) on the next finished samples
whatever their age. Each sample's lag is the trainer's version minus the oldest version among its
tokens; the largest is reported, and never exceeds K but for `unbounded`.

Busy fraction = decoding slot-time / (slots x the loop's wall time), from the first admission to
the last step's load; samples/s over the same window.
"""

from __future__ import annotations

import argparse
import heapq
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

Mode = Literal["partial", "drain"]
Policy = Literal["in_order", "first_finished", "unbounded"]


@dataclass(frozen=True)
class LoopConfig:
    """One loop's settings (defaults: `benchmarks/rl_loop.py`'s sim engine)."""

    slots: int = 256
    step_s: float = 0.004  # one decode step of every running sequence
    prefill_tokens_per_s: float = 50_000.0  # 0: prefill is free
    prompt_tokens: int = 64
    median_tokens: float = 300.0
    p99_tokens: float = 4000.0
    max_new_tokens: int = 16_384
    steps: int = 10
    samples: int = 512  # per step
    job_size: int = 1  # samples a job commits together (a finished sample waits for its job's others)
    train_fraction: float = 0.0  # the trainer's step, as a share of a step's generation time at full occupancy
    push_s: float = 0.0
    load_s: float = 0.05
    max_staleness: int = 1
    mode: Mode = "partial"
    policy: Policy = "first_finished"
    seed: int = 0
    lengths: tuple[int, ...] | None = None  # fixed output lengths, cycled (tests); else drawn

    @property
    def train_s(self) -> float:
        mean = float(np.mean(self.output_lengths()))
        return self.train_fraction * self.samples * mean * self.step_s / self.slots

    def output_lengths(self) -> np.ndarray:
        count = (self.steps + self.max_staleness) * self.samples
        if self.lengths is not None:
            return np.resize(np.array(self.lengths, dtype=np.int64), count)
        sigma = math.log(self.p99_tokens / self.median_tokens) / 2.326
        drawn = np.random.default_rng(self.seed).lognormal(math.log(self.median_tokens), sigma, count)
        return np.clip(np.ceil(drawn), 1, self.max_new_tokens).astype(np.int64)


@dataclass
class LoopResult:
    """The model's figures for one loop."""

    config: LoopConfig
    busy: float
    samples_per_s: float
    seconds: float
    max_lag: int
    mixed_rows: int  # samples with tokens of two or more versions
    idle_reasons: dict[str, float] = field(default_factory=dict)  # slot-seconds idle, by cause


@dataclass
class _Sample:
    index: int
    slot_step: int  # the training step it was submitted for
    length: int
    started_at: int = 0  # the decode step it started at
    first_version: int = -1  # -1: not started
    versions: int = 0  # distinct versions among its tokens
    finished: bool = False
    trained: bool = False


class _Loop:
    """The state of one simulated loop; `run()` advances it event by event."""

    def __init__(self, config: LoopConfig) -> None:
        self.c = config
        self.samples = [_Sample(i, i // config.samples, int(n)) for i, n in enumerate(config.output_lengths())]
        self.train_s = config.train_s
        self.t = 0.0
        self.decode_step = 0
        self.engine_version = self.trainer_version = 0
        self.load_pending = False  # a pushed version the engine has not loaded yet
        self.next_admit = 0
        self.running: list[tuple[int, int]] = []  # heap of (finishing decode step, index)
        self.waiting: list[int] = []  # admitted, waiting for a slot
        self.finished: list[int] = []  # finished, not trained yet
        self.train_done_at: float | None = None
        self.busy = 0.0
        self.idle = {"tail": 0.0, "staleness": 0.0, "swap": 0.0, "prefill": 0.0, "trainer": 0.0}
        self.max_lag = self.mixed = self.trained = 0

    # -- the engine --------------------------------------------------------------------------

    def admit(self) -> None:
        """Queue every sample whose step the staleness bound lets start on the engine's version."""
        while (self.next_admit < len(self.samples)
               and self.samples[self.next_admit].slot_step - self.c.max_staleness <= self.engine_version):
            self.waiting.append(self.next_admit)
            self.next_admit += 1

    def stall(self, tokens: int) -> None:
        if self.c.prefill_tokens_per_s > 0:
            seconds = tokens / self.c.prefill_tokens_per_s
            self.idle["prefill"] += seconds * self.c.slots
            self.t += seconds

    def fill_slots(self) -> None:
        if self.load_pending and self.c.mode == "drain":
            return
        started = 0
        while self.waiting and len(self.running) < self.c.slots:
            sample = self.samples[self.waiting.pop(0)]
            sample.first_version, sample.versions, sample.started_at = self.engine_version, 1, self.decode_step
            heapq.heappush(self.running, (self.decode_step + sample.length, sample.index))
            started += 1
        self.stall(started * self.c.prompt_tokens)

    def load(self) -> None:
        """The pushed version loads (partial: at once; drain: once the engine is empty)."""
        self.t += self.c.load_s
        self.idle["swap"] += self.c.load_s * self.c.slots
        self.engine_version = self.trainer_version
        self.load_pending = False
        if self.running:  # partial: the sequences continue on the new weights after a prefill
            context = 0
            for _, index in self.running:
                sample = self.samples[index]
                sample.versions += 1
                context += self.c.prompt_tokens + self.decode_step - sample.started_at
            self.stall(context)
        self.admit()

    # -- the trainer -------------------------------------------------------------------------

    def batch(self) -> list[int] | None:
        """The samples step `trainer_version` trains on, once it can (None: not yet)."""
        v, k = self.trainer_version, self.c.max_staleness
        if self.c.policy == "in_order":
            mine = [i for i in self.finished if self.samples[i].slot_step == v]
            return mine if len(mine) == self.c.samples else None
        if self.c.policy == "unbounded":  # `rl_loop.py`'s trainer: the next finished samples, no bound on lag
            return self.finished[:self.c.samples] if len(self.finished) >= self.c.samples else None
        # A sample untrained at lag K must be trained now: wait for any still running.
        if any(not s.finished and s.first_version >= 0 and v - s.first_version >= k
               for s in self.samples[:self.next_admit]):
            return None
        ready = sorted(self.finished, key=lambda i: (self.samples[i].first_version, i))
        return ready[:self.c.samples] if len(ready) >= self.c.samples else None

    def train(self) -> None:
        batch = self.batch()
        if batch is None:
            return
        for index in batch:
            self.finished.remove(index)
            sample = self.samples[index]
            sample.trained = True
            self.max_lag = max(self.max_lag, self.trainer_version - sample.first_version)
            self.mixed += sample.versions > 1
        self.trained += len(batch)
        self.train_done_at = self.t + self.train_s + self.c.push_s

    # -- time --------------------------------------------------------------------------------

    def idle_reason(self) -> str:
        if self.load_pending and self.c.mode == "drain":
            return "swap"
        if self.train_done_at is not None:
            return "trainer"  # nothing admissible while the trainer trains
        return "staleness" if self.next_admit < len(self.samples) else "tail"

    def advance(self) -> None:
        """To the next event: a sequence finishes, or the trainer's step (and push) is done."""
        horizon = self.train_done_at
        if not self.running:
            if horizon is None:
                raise RuntimeError(f"the loop is stuck at step {self.trainer_version}: no work and no event")
            self.idle[self.idle_reason()] += (horizon - self.t) * self.c.slots
            self.t = max(self.t, horizon)
            return
        steps = self.running[0][0] - self.decode_step
        if horizon is not None:
            steps = max(1, min(steps, math.ceil((horizon - self.t) / self.c.step_s)))
        seconds = steps * self.c.step_s
        self.busy += len(self.running) * seconds
        self.idle[self.idle_reason()] += (self.c.slots - len(self.running)) * seconds
        self.t += seconds
        self.decode_step += steps
        while self.running and self.running[0][0] <= self.decode_step:
            _, index = heapq.heappop(self.running)
            self.samples[index].finished = True
            first = index - index % self.c.job_size
            job = range(first, min(first + self.c.job_size, len(self.samples)))
            if all(self.samples[i].finished for i in job):  # the job commits: its samples reach the trainer
                self.finished.extend(job)

    def run(self) -> LoopResult:
        self.admit()
        while True:
            if self.load_pending and (self.c.mode == "partial" or not self.running):
                self.load()
                if self.trainer_version == self.c.steps:
                    break
            self.fill_slots()
            if self.train_done_at is None and self.trainer_version < self.c.steps:
                self.train()
            if self.train_done_at is not None and self.t >= self.train_done_at:
                self.train_done_at = None
                self.trainer_version += 1
                self.load_pending = True
                continue
            self.advance()
        seconds = self.t
        return LoopResult(self.c, self.busy / (self.c.slots * seconds), self.trained / seconds, seconds,
                          self.max_lag, self.mixed, {k: v / (self.c.slots * seconds) for k, v in self.idle.items()})


def simulate(config: LoopConfig) -> LoopResult:
    """Run the loop to the last step's load; see the module docstring."""
    return _Loop(config).run()


def synchronous(config: LoopConfig) -> LoopConfig:
    """The loop a competent user runs today (TRL's): generate a step's samples, drain, train, push."""
    return replace(config, max_staleness=0, mode="drain", policy="in_order")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--cap", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--train-fraction", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    parser.add_argument("--step-ms", type=float, default=16.0, help="one decode step of the engine's 256 slots")
    parser.add_argument("--policy", choices=["in_order", "first_finished", "unbounded"], default="first_finished")
    parser.add_argument("--seeds", type=int, default=3, help="length draws per point (median, with the range)")
    args = parser.parse_args(argv)
    print("the loop model's figures (benchmarks/loop_model.py), not a measurement")
    print(f"{'cap':>6} {'train':>6} {'mode':>22} {'busy':>16} {'samples/s':>10} {'x sync':>7} {'max lag':>7} "
          "idle: tail / staleness / trainer / swap / prefill")
    for cap in args.cap:
        for fraction in args.train_fraction:
            base = LoopConfig(steps=args.steps, samples=args.samples, max_new_tokens=cap, step_s=args.step_ms / 1000,
                              train_fraction=fraction, prefill_tokens_per_s=args.prefill_tokens_per_s,
                              policy=args.policy)
            rows = [("synchronous", synchronous(base))]
            for k in args.max_staleness:
                rows += [(f"drain K={k}", replace(base, mode="drain", max_staleness=k)),
                         (f"partial K={k}", replace(base, mode="partial", max_staleness=k))]
            sync_rate: list[float] = []
            for name, config in rows:
                results = [simulate(replace(config, seed=seed)) for seed in range(args.seeds)]
                busy = [r.busy for r in results]
                rate = [r.samples_per_s for r in results]
                if name == "synchronous":
                    sync_rate = rate
                ratio = statistics.median(r / b for r, b in zip(rate, sync_rate, strict=True))
                idle = {key: statistics.median(r.idle_reasons[key] for r in results) for key in results[0].idle_reasons}
                print(f"{cap:>6} {fraction:>6.2f} {name:>22} {statistics.median(busy):>6.1%} "
                      f"[{min(busy):.0%}-{max(busy):.0%}] {statistics.median(rate):>10.1f} {ratio:>6.2f}x "
                      f"{max(r.max_lag for r in results):>7} "
                      + " / ".join(f"{idle[key]:.0%}" for key in ("tail", "staleness", "trainer", "swap", "prefill")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

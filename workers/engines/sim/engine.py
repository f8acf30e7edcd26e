"""The `sim` engine: a simulated continuous-batching engine for benchmarks and scheduling tests.

It has a capacity (sequences decoded at once), a per-step latency model
(`step_s + step_per_seq_s * running`), output lengths drawn from a lognormal given by its
median and p99, and deterministic tokens and logprobs from a seed. Sequences wait in FIFO
order for a free slot, as in SGLang's scheduler. A background thread advances the steps by
wall-clock time; `stats()` reports utilisation = busy slot-steps / capacity slot-steps, idle
time included. With zero latency (infinite speed) `submit` answers at once.

Prefill is paid as an engine pays it: a sequence admitted to a slot first needs its context
(prompt, or prompt + tokens so far for a continuation) in the KV cache. The engine keeps a
prefix cache (`workers.engines.sim.prefix_cache`: bounded, LRU over blocks of token ids, as vLLM's
automatic prefix caching and SGLang's radix cache are), so only the uncached part is computed,
at `prefill_tokens_per_s`; while it computes, no sequence decodes (the engine stalls, and the
stall counts as idle capacity). A weight swap empties the cache, as SGLang flushes its cache at
a load: a sample continued after a partial swap pays the prefill of its prompt and every token
it generated. `cached_tokens` of each output says how much of its context was found cached.

It implements the optional concurrent interface (`capacity`, `load()`, `submit()`), so a
worker keeps several jobs in flight on it, and the interruptible one for partial weight swaps:
`interrupt()` stops every sequence at the current step, each keeping the tokens it generated so
far (a waiting one none), and a `ContinuedRequest` resumes sample i where it stopped: it yields
the rest of the same planned sequence (length and ids drawn from the original sample's seed),
stamped with the version serving when it runs.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.weights.safetensors_io import TensorBits
from schemas.adapters import AdapterRecord
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities, WorkerInfo
from workers.engines.adapters.cache import DEFAULT_MAX_ADAPTERS, AdapterCache
from workers.engines.base import (
    INTERRUPTED,
    ContinuedRequest,
    EngineDescription,
    EngineIdentity,
    Finish,
    SampleOutput,
)
from workers.engines.sim.prefix_cache import PrefixCache
from workers.errors import WeightsRefusedError

# Files of a model checkpoint (beside its config.json) that the sim refuses to pretend to serve.
CHECKPOINT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The standard normal quantile of 0.99: p99 = median * exp(sigma * Z99).
Z99 = 2.3263478740408408


@dataclass(frozen=True)
class SimConfig:
    capacity: int = 256
    step_s: float = 0.0  # latency of one decode step; 0 with step_per_seq_s 0 is infinite speed
    step_per_seq_s: float = 0.0  # added per running sequence
    median_tokens: float = 300.0
    p99_tokens: float = 4000.0
    seed: int = 0
    vocab_size: int = 151_936
    eos_token_id: int = 0
    max_top_logprobs: int = 0
    weight_version: int = 0
    load_s: float = 0.0  # weight load time
    # Take a pushed path that holds a real model checkpoint (`--allow-sim-in-real-pool`): by
    # default the sim refuses one, so it never labels its made-up tokens as a real model's weights.
    real_weights: bool = False
    # (layers, top_k, experts): a simulated mixture-of-experts model that serves routed experts.
    experts: tuple[int, int, int] | None = None
    tick_s: float = 0.002  # how often the step thread wakes (admission latency)
    # Prefill: uncached context tokens computed per second (0: prefill is free), and the prefix
    # cache's size in tokens (0: no cache) in blocks of `block_tokens`.
    prefill_tokens_per_s: float = 50_000.0
    prefix_cache_tokens: int = 1 << 20
    block_tokens: int = 16
    # LoRA adapters kept resident (`workers.engines.adapters.cache`); each changes the draws by its bits.
    max_adapters: int = DEFAULT_MAX_ADAPTERS

    @property
    def sigma(self) -> float:
        return math.log(self.p99_tokens / self.median_tokens) / Z99 if self.p99_tokens > self.median_tokens else 0.0

    @property
    def infinite_speed(self) -> bool:
        return self.step_s <= 0 and self.step_per_seq_s <= 0


@dataclass
class SimStats:
    steps: float
    busy_slot_steps: float
    capacity_slot_steps: float
    prefill_tokens: int = 0  # context tokens computed at admission
    cached_tokens: int = 0  # context tokens found in the prefix cache instead
    prefill_s: float = 0.0  # time the engine stalled computing them

    @property
    def utilisation(self) -> float:
        return self.busy_slot_steps / self.capacity_slot_steps if self.capacity_slot_steps else 0.0


class _Batch:
    """One submit: its outputs are ready up front; the future resolves when its last sequence ends."""

    def __init__(self, outputs: list[list[SampleOutput]], future: Future) -> None:
        self.outputs = outputs
        self.future = future
        self.left = sum(len(samples) for samples in outputs)
        self.cancelled = False


@dataclass(eq=False)
class _Seq:
    """One sample's sequence in the engine: waiting (`started` None) or running since `started`."""

    batch: _Batch
    request: int
    sample: int
    length: int
    context: np.ndarray  # the ids the engine must hold before decoding: prompt (+ generated so far)
    started: float | None = None


def _sample_seed(config: SimConfig, request: RolloutRequest, index: int, adapter: int | None) -> list[int]:
    seed = request.sampling_params.seed
    key = seed if seed is not None else zlib.crc32(request.id.encode())
    return [config.seed, key, index] if adapter is None else [config.seed, key, index, adapter]


def adapter_seed(tensors: Sequence[TensorBits]) -> int:
    """What a LoRA adapter's bits change in the sim's draws: a digest of them (another version, other tokens)."""
    digest = 0
    for tensor in tensors:
        digest = zlib.crc32(tensor.words.tobytes(), zlib.crc32(tensor.name.encode(), digest))
    return digest


def simulate_sample(config: SimConfig, request: RolloutRequest, index: int, weight_version: int,
                    adapter: int | None = None) -> SampleOutput:
    """The deterministic output of sample `index` of `request` (same seed, same tokens; `adapter`, the
    `adapter_seed` of the request's adapter, changes them); for a continuation, the rest of its original
    sample's planned sequence."""
    if isinstance(request, ContinuedRequest):
        done = request.generated
        whole = _planned(config, request, request.sample_index, done + request.sampling_params.max_new_tokens,
                         adapter)
        tops = whole.top_logprobs
        return SampleOutput(
            token_ids=whole.token_ids[done:], finish=whole.finish,
            logprobs=None if whole.logprobs is None else whole.logprobs[done:],
            top_logprobs=None if tops is None else tops[done:], prompt_logprobs=whole.prompt_logprobs,
            weight_version=weight_version,
        )
    output = _planned(config, request, index, request.sampling_params.max_new_tokens, adapter)
    output.weight_version = weight_version
    return output


def _planned(config: SimConfig, request: RolloutRequest, index: int, max_new_tokens: int,
             adapter: int | None) -> SampleOutput:
    params = request.sampling_params
    rng = np.random.default_rng(_sample_seed(config, request, index, adapter))
    drawn = max(1, math.ceil(config.median_tokens * math.exp(config.sigma * rng.standard_normal())))
    user_stops = params.user_stop_token_ids
    stop_id = user_stops[0] if user_stops else config.eos_token_id
    if params.ignore_eos and not user_stops:
        drawn = max_new_tokens + 1
    length = min(drawn, max_new_tokens)
    # Zipf-like unigram ids (a rank's id), like real text rather than uniform noise.
    ids = (rng.zipf(1.2, length) % (config.vocab_size - 1) + 1).astype(np.int32)
    if length < drawn or length == 0:
        finish = Finish("length")
    else:
        ids[-1] = stop_id
        finish = Finish("stop", matched=stop_id)
    logprobs = None
    tops = None
    if request.logprobs is not None:
        logprobs = (-rng.exponential(0.6, length)).astype(np.float32)
        k = request.logprobs
        if k:
            tops = [[(int(t + j) % config.vocab_size, float(lp) - j) for j in range(k)]
                    for t, lp in zip(ids.tolist(), logprobs.tolist(), strict=True)]
    prompt_lp = None
    if request.prompt_logprobs is not None:
        prompt_lp = [None, *(-rng.exponential(2.0, len(request.input_ids) - 1)).astype(np.float32).tolist()]
    routed = None
    if request.return_routed_experts and config.experts is not None:
        layers, top_k, experts = config.experts
        rows = max(0, len(request.input_ids) + length - 1)
        # top_k distinct experts per (position, layer), ascending as the contract stores them.
        picks = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :top_k]
        routed = np.sort(picks, axis=-1).astype(np.uint16)
    return SampleOutput(token_ids=ids, finish=finish, logprobs=logprobs, top_logprobs=tops,
                        prompt_logprobs=prompt_lp, routed_experts=routed)


def refuse_checkpoint(path: str) -> None:
    """`WeightsRefusedError` when `path` holds a model checkpoint (a config.json or weight files):
    the sim serves only its own weights, a path with nothing a model loads (e.g. `/ckpt/v3`)."""
    local = Path(path.removeprefix("file://"))
    found = sorted(p.name for p in local.iterdir() if p.name == "config.json" or p.suffix in CHECKPOINT_FILES) \
        if local.is_dir() else [local.name] if local.suffix in CHECKPOINT_FILES and local.is_file() else []
    if found:
        raise WeightsRefusedError(
            f"{path} holds a model checkpoint ({', '.join(found[:3])}): the sim engine generates made-up tokens "
            "and would label them as those weights. It serves a pool whose weights are the sim's (a path with "
            "no checkpoint); start it with a --pool of its own, or with --allow-sim-in-real-pool to run it in "
            "this pool anyway (its rows say engine=sim)"
        )


class SimEngine(EngineIdentity):
    """A continuous-batching engine in simulation: slots, steps, a waiting queue."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self._weight_version = self.config.weight_version
        self._description = EngineDescription(
            name="sim", model=f"sim-c{self.config.capacity}",
            capabilities=Capabilities(max_top_logprobs=self.config.max_top_logprobs,
                                      routed_experts=self.config.experts is not None,
                                      vocab_size=self.config.vocab_size),
            num_experts=None if self.config.experts is None else self.config.experts[2],
            has_tokenizer=False,
        )
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._running: list[tuple[float, int, _Seq]] = []  # heap of (finish step, seq no, sequence)
        self._load = 0
        self._seq = 0
        self._step = 0.0
        self._busy = 0.0
        self._capacity_steps = 0.0
        self._closed = False
        self._cache = PrefixCache(self.config.prefix_cache_tokens, self.config.block_tokens)
        self._adapter_seeds: dict[str, int] = {}
        self.adapters = AdapterCache(self._load_adapter, self._adapter_seeds.pop, self.config.max_adapters)
        self._prefill_tokens = 0
        self._cached_tokens = 0
        self._prefill_s = 0.0
        self._stall_s = 0.0  # prefill time the step thread still owes before decoding on
        self.submitted_at: list[tuple[float, int]] = []  # (monotonic time, sequences) per submit
        self._thread: threading.Thread | None = None
        if not self.config.infinite_speed:
            self._thread = threading.Thread(target=self._loop, name="sim-engine", daemon=True)
            self._thread.start()

    # -- Engine protocol --------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.config.capacity

    def load(self) -> int:
        """Sequences submitted and not finished (running and waiting)."""
        return self._load

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        return self.submit(requests).result()

    def submit(self, requests: Sequence[RolloutRequest]) -> Future[list[list[SampleOutput]]]:
        version = self._weight_version
        self.adapters.ensure(r.adapter for r in requests if r.adapter is not None)
        seeds = self._adapter_seeds
        outputs = [[simulate_sample(self.config, r, i, version, None if r.adapter is None else seeds[r.adapter])
                    for i in range(r.sampling_params.n)] for r in requests]
        future: Future[list[list[SampleOutput]]] = Future()  # left pending, so cancel() works
        batch = _Batch(outputs, future)
        with self._cond:
            if self._closed:
                raise RuntimeError("the sim engine is closed")
            self.submitted_at.append((time.monotonic(), batch.left))
            if self.config.infinite_speed or batch.left == 0:
                for request, samples in zip(requests, outputs, strict=True):
                    context = np.asarray(request.input_ids, dtype=np.int32)
                    for sample in samples:
                        sample.cached_tokens = self._prefill(context)
                        self._cache.insert(np.concatenate([context, sample.token_ids]))
                future.set_result(outputs)
                return future
            for r, samples in enumerate(outputs):
                context = np.asarray(requests[r].input_ids, dtype=np.int32)
                for i, sample in enumerate(samples):
                    self._waiting.append(_Seq(batch, r, i, max(1, len(sample.token_ids)), context))
            self._load += batch.left
            self._cond.notify_all()
        future.add_done_callback(lambda f: self._on_cancel(batch) if f.cancelled() else None)
        return future

    def _load_adapter(self, key: str, record: AdapterRecord, tensors: list[TensorBits]) -> None:
        self._adapter_seeds[key] = adapter_seed(tensors)

    def refuses_pool(self, workers: Sequence[WorkerInfo]) -> str | None:
        """Why the sim does not join a pool with nothing pushed that these live workers serve: one of
        them is a real engine (its rows are a real model's at the version it started with), unless
        `real_weights`; None to join."""
        if self.config.real_weights:
            return None
        real = Counter((w.engine, w.model) for w in workers if w.engine != "sim")
        if not real:
            return None
        serving = ", ".join(f"{count} {engine} worker(s) with model {model}" for (engine, model), count in
                            sorted(real.items()))
        return (f"the pool has no pushed weights and real engines serve it ({serving}): the sim's made-up tokens "
                "would be rows of that pool beside theirs. Start it with a --pool of its own, or with "
                "--allow-sim-in-real-pool to run it in this pool anyway (its rows say engine=sim)")

    def update_weights(self, path: str, version: int) -> None:
        if not self.config.real_weights:
            refuse_checkpoint(path)
        if self.config.load_s:
            time.sleep(self.config.load_s)
        with self._cond:
            self._weight_version = version
            self._cache.clear()  # the old weights' KV entries are no use to the new ones

    def interrupt(self) -> int:
        """Stop every sequence at the current step; each batch resolves with what it generated."""
        with self._cond:
            stopped = [seq for _, _, seq in self._running] + list(self._waiting)
            self._running = []
            self._waiting.clear()
            self._load -= len(stopped)
            batches: dict[int, _Batch] = {}
            for seq in stopped:
                so_far = self._so_far(seq)
                if seq.started is not None:
                    self._cache.insert(np.concatenate([seq.context, so_far.token_ids]))
                seq.batch.outputs[seq.request][seq.sample] = so_far
                seq.batch.left -= 1
                batches[id(seq.batch)] = seq.batch
        for batch in batches.values():
            if not batch.cancelled and batch.left == 0:
                batch.future.set_result(batch.outputs)
        return len(stopped)

    def progress(self, future: Future[list[list[SampleOutput]]]) -> list[list[SampleOutput]] | None:
        """The batch's samples so far, without stopping them (a worker's checkpoint): finished ones
        whole, running ones cut at the current step (never at their last token), waiting ones
        empty, the unfinished ones interrupted; None once the batch resolved."""
        with self._cond:
            live = [seq for _, _, seq in self._running if seq.batch.future is future]
            live += [seq for seq in self._waiting if seq.batch.future is future]
            if not live or future.done():
                return None
            outputs = [list(samples) for samples in live[0].batch.outputs]
            for seq in live:
                outputs[seq.request][seq.sample] = self._so_far(seq)
            return outputs

    def _so_far(self, seq: _Seq) -> SampleOutput:
        """A sequence's planned output cut at the current step (never at its last token), interrupted."""
        output = seq.batch.outputs[seq.request][seq.sample]
        generated = 0 if seq.started is None else int(self._step - seq.started)
        kept = min(max(0, generated), len(output.token_ids) - 1)
        return SampleOutput(
            token_ids=output.token_ids[:kept], finish=Finish("abort", message=INTERRUPTED),
            logprobs=None if output.logprobs is None else output.logprobs[:kept],
            top_logprobs=None if output.top_logprobs is None else output.top_logprobs[:kept],
            prompt_logprobs=output.prompt_logprobs, weight_version=output.weight_version,
            cached_tokens=output.cached_tokens,
        )

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        return None  # no tokenizer: stop strings are refused before they reach this engine

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- simulation -------------------------------------------------------------------------

    def stats(self) -> SimStats:
        with self._cond:
            return SimStats(self._step, self._busy, self._capacity_steps, self._prefill_tokens,
                            self._cached_tokens, self._prefill_s)

    def reset_stats(self) -> None:
        with self._cond:
            self._busy = self._capacity_steps = self._prefill_s = 0.0
            self._prefill_tokens = self._cached_tokens = 0

    def _prefill(self, context: np.ndarray) -> int:
        """Charge the prefill of `context`'s uncached part (the engine stalls for it); its cached
        token count. The context's blocks are cached from now on (they are in the KV cache)."""
        cached = self._cache.lookup(context)
        computed = len(context) - cached
        self._cached_tokens += cached
        self._prefill_tokens += computed
        if self.config.prefill_tokens_per_s > 0 and not self.config.infinite_speed:
            stall = computed / self.config.prefill_tokens_per_s
            self._stall_s += stall
            self._prefill_s += stall
        self._cache.insert(context)
        return cached

    def _on_cancel(self, batch: _Batch) -> None:
        with self._cond:
            batch.cancelled = True
            self._load -= batch.left
            self._waiting = deque(seq for seq in self._waiting if seq.batch is not batch)
            self._running = [item for item in self._running if item[2].batch is not batch]
            heapq.heapify(self._running)

    def _step_time(self, running: int) -> float:
        return max(1e-6, self.config.step_s + self.config.step_per_seq_s * running)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.capacity:
            seq = self._waiting.popleft()
            seq.batch.outputs[seq.request][seq.sample].cached_tokens = self._prefill(seq.context)
            seq.started = self._step
            self._seq += 1
            heapq.heappush(self._running, (self._step + seq.length, self._seq, seq))

    def _loop(self) -> None:
        last = time.monotonic()
        with self._cond:
            while not self._closed:
                self._admit()
                now = time.monotonic()
                elapsed, last = now - last, now
                running = len(self._running)
                if self._stall_s > 0:  # prefill first: no sequence decodes meanwhile
                    paid = min(elapsed, self._stall_s)
                    self._stall_s -= paid
                    elapsed -= paid
                    self._capacity_steps += paid / self._step_time(running) * self.config.capacity
                steps = elapsed / self._step_time(running)
                # Advance in spans between finish events, each with its own running count.
                while steps > 0:
                    if not self._running:
                        self._capacity_steps += steps * self.config.capacity
                        self._step += steps
                        break
                    span = min(steps, self._running[0][0] - self._step)
                    self._busy += span * len(self._running)
                    self._capacity_steps += span * self.config.capacity
                    self._step += span
                    steps -= span
                    self._finish_due()
                    self._admit()
                    if steps > 0:  # rescale what is left to the new running count
                        steps *= self._step_time(running) / self._step_time(len(self._running))
                        running = len(self._running)
                if self._running or self._waiting:
                    self._cond.wait(self.config.tick_s)
                else:
                    self._cond.wait(0.05)

    def _finish_due(self) -> None:
        while self._running and self._running[0][0] <= self._step + 1e-9:
            _, _, seq = heapq.heappop(self._running)
            batch = seq.batch
            self._cache.insert(np.concatenate([seq.context, batch.outputs[seq.request][seq.sample].token_ids]))
            self._load -= 1
            batch.left -= 1
            if batch.left == 0 and not batch.cancelled:
                batch.future.set_result(batch.outputs)

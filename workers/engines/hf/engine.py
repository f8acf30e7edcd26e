"""The `hf` engine: transformers on CPU (or GPU), the embedded default and the test engine.

It decodes token by token with a KV cache, so generation really ends at the first stop (string
or token id), and computes logprobs with SGLang's semantics: log-softmax of the (penalised)
logits divided by the temperature, before top-k/top-p/min-p filtering; plain log-softmax for
greedy requests. Penalties count generated tokens only (never the prompt's), additive ones
before repetition scaling, as SGLang's penalizers under its overlap scheduler. A job's requests
are decoded together: every sample of every request is a row of one left-padded batch (attention
mask and explicit position ids), up to `max_batch_sequences` rows, each row with its own
request's sampling parameters and its own generator seeded from (seed, sample index). Batched
matmuls may round differently from a lone request's, as in any batching engine (SGLang
included).

For mixture-of-experts models it captures routed experts (`return_routed_experts`) with
forward hooks on the routers (`workers.engines.hf.expert_capture`), in SGLang's layout: start 0,
one row per position fed through the model — every prompt position and every completion
position but the last sampled token, which was never fed — so `prompt + completion - 1` rows.

It has the concurrent and interruptible interfaces (`workers.engines.serial.SerialFeed`): batches
run one after another on the engine's own thread, and `interrupt()` ends the running decode loop
at its next step keeping every sample's tokens (a partial weight swap). A `ContinuedRequest`
decodes the original prompt + generated ids as its prompt and draws from its continuation seed.
`progress(future)` snapshots the running batch's samples at a step boundary without stopping them
(a worker's periodic checkpoints, `workers.jobs.checkpoint`).

LoRA adapters (`peft`): a request naming one (pinned to its version, `workers.jobs.adapters`) is
decoded with it, in the same batch as base requests and other adapters' (peft's mixed-batch
forward, `adapter_names`: each row through its own adapter, `__base__` rows through the base
weights alone). The adapters a batch needs are loaded from their store on the engine's thread
before it runs; past `max_adapters` the least recently used are deleted
(`workers.engines.adapters.cache`). Base weight pushes change the base tensors under them in place;
a reload from a directory (`update_weights`) drops them (they load again on demand).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.stop_tokens import matched_stop_ids, model_stop_ids
from pipeline.core.weights.safetensors_io import TensorBits
from schemas.adapters import AdapterRecord
from schemas.request import RolloutRequest, SamplingParams
from schemas.worker_info import Capabilities
from workers.engines.adapters.cache import BASE, DEFAULT_MAX_ADAPTERS, AdapterCache
from workers.engines.base import INTERRUPTED, EngineDescription, EngineIdentity, Finish, SampleOutput
from workers.engines.hf.expert_capture import RoutingCapture
from workers.engines.seeds import request_sample_seed
from workers.engines.serial import SerialFeed, interrupted_before_start
from workers.errors import EngineUnavailableError, UnsupportedRequestError

# Samples decoded together: a job's requests are batched (left-padded) up to this many sequences.
DEFAULT_MAX_BATCH_SEQUENCES = 64


class HFEngine(SerialFeed, EngineIdentity):
    """A transformers causal LM loaded once from a local directory."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        max_top_logprobs: int = 0,
        weight_version: int = 0,
        model_name: str | None = None,
        max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.max_batch_sequences = max(1, max_batch_sequences)
        self._feed_capacity = self.max_batch_sequences
        path = Path(model_path)
        _check_model_dir(path)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.model.eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None
        self.hidden_stop_ids = model_stop_ids(path, self.tokenizer)  # SGLang's rule (`pipeline.core.stop_tokens`)
        self.vocab_size = int(self.model.config.vocab_size)
        self._routing = RoutingCapture.attach(self.model)
        self._weight_version = weight_version
        self._peft: Any = None  # the model wrapped by peft once an adapter is loaded
        self.adapters = AdapterCache(self._load_adapter, self._unload_adapter, max_adapters)
        # The running batch's samples so far, for `progress` (updated once per decode step).
        self._live_lock = threading.Lock()
        self._live: _LiveBatch | None = None
        self._description = EngineDescription(
            name="hf",
            model=model_name or str(path),
            capabilities=Capabilities(
                max_top_logprobs=max_top_logprobs,
                prompt_logprobs=True,
                routed_experts=self._routing is not None,
                vocab_size=self.vocab_size,
            ),
            num_experts=self._routing.layout.num_experts if self._routing is not None else None,
            has_tokenizer=self.tokenizer is not None,
        )

    @property
    def routing(self) -> RoutingCapture | None:
        """The router hooks of a mixture-of-experts model (None for a dense one)."""
        return self._routing

    def update_weights(self, path: str, version: int) -> None:
        """Reload the model from `path` (same architecture and vocabulary); keep the old one on failure."""
        torch = self._torch
        from transformers import AutoModelForCausalLM

        source = Path(path)
        _check_model_dir(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(self.device)
        if int(model.config.vocab_size) != self.vocab_size:
            raise EngineUnavailableError(
                f"{source} has vocab size {model.config.vocab_size}, the loaded model {self.vocab_size}"
            )
        if self.model is not None:
            old = {name: tuple(p.shape) for name, p in self.model.state_dict().items()}
            new = {name: tuple(p.shape) for name, p in model.state_dict().items()}
            if old != new:
                differing = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
                raise EngineUnavailableError(
                    f"{source} does not match the loaded model's parameters ({len(differing)} differ, "
                    f"e.g. {differing[0]})"
                )
        model.eval()
        routing = RoutingCapture.attach(model)
        if (routing is None) != (self._routing is None) or (
            routing is not None and self._routing is not None and routing.layout != self._routing.layout
        ):
            if routing is not None:
                routing.remove()
            raise EngineUnavailableError(f"{source} routes experts differently from the loaded model")
        if self._routing is not None:
            self._routing.remove()
        self._routing = routing
        self.model = model
        self._peft = None  # the adapters were injected into the old model: loaded again on demand
        self.adapters.clear()
        self._weight_version = version

    def apply_store_version(self, store: Any, have: int | None, version: int) -> Any:
        """Take the loaded model's tensors in place from `have` to `version` of a weight store,
        checked bit for bit (`workers.engines.inplace.apply_version`); `Applied` says how."""
        from workers.engines.inplace import apply_version

        applied = apply_version(store, self._base_state_dict(), have, version)
        self._weight_version = version
        return applied

    def stage_store_version(self, store: Any, have: int | None, version: int) -> Any:
        """`version` of a weight store computed and checked beside the loaded model while it keeps
        generating (`workers.engines.inplace.stage_version`); `install_store_version` puts it in."""
        from workers.engines.inplace import stage_version

        return stage_version(store, self._base_state_dict(), have, version,
                             parameters=_base_names(dict(self.model.named_parameters(remove_duplicate=False))))

    def _base_state_dict(self) -> dict[str, Any]:
        """The base model's tensors under their own names (peft's LoRA layers hold them as `base_layer`)."""
        return _base_names(self.model.state_dict())

    def _load_adapter(self, key: str, record: AdapterRecord, tensors: list[TensorBits]) -> None:
        """Inject adapter `key` (its config and LoRA tensors) beside the resident ones."""
        from peft import PeftConfig, PeftModel, set_peft_model_state_dict

        from pipeline.core.weights.torch_bits import from_words

        config = PeftConfig.from_peft_type(**{**record.config, "inference_mode": True})
        state = {t.name: from_words(t.words, t.dtype, t.shape).to(self.device, self._torch.float32, copy=True)
                 for t in tensors}
        if self._peft is None:
            self._peft = PeftModel(self.model, config, adapter_name=key)
        else:
            self._peft.add_adapter(key, config)
        loaded = set_peft_model_state_dict(self._peft, state, adapter_name=key)
        if loaded.unexpected_keys:
            self._peft.delete_adapter(key)
            raise ValueError(f"tensors that fit no module of the model: {loaded.unexpected_keys[:3]}")
        self._peft.eval()

    def _unload_adapter(self, key: str) -> None:
        self._peft.delete_adapter(key)

    def forward(self, adapters: Sequence[str | None], **kwargs: Any) -> Any:
        """The model's forward over a batch, each row through its pinned adapter (None: the base alone)."""
        if self._peft is None:
            return self.model(**kwargs)
        return self._peft(**kwargs, adapter_names=[a or BASE for a in adapters])

    def install_store_version(self, staged: Any) -> Any:
        """Put a staged version in (the engine paused: between batches, or interrupted); `Applied`."""
        applied = staged.install()
        self._weight_version = applied.version
        return applied

    def close(self) -> None:
        self._close_feed()
        if self._routing is not None:
            self._routing.remove()
            self._routing = None
        self.model = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        return self._run_batch(requests, None)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _run_batch(self, requests: Sequence[RolloutRequest], stop: threading.Event | None) -> list[list[SampleOutput]]:
        for request in requests:
            if request.return_routed_experts and self._routing is None:
                raise UnsupportedRequestError(
                    f"request {request.id!r} asks for routed experts; {self._description.model} is not a "
                    "mixture-of-experts model"
                )
        self.adapters.ensure(r.adapter for r in requests if r.adapter is not None)
        out: list[list[SampleOutput]] = []
        live = _LiveBatch(list(requests), out)
        with self._live_lock:
            self._live = live
        try:
            with self._torch.inference_mode():
                for group in _groups(requests, self.max_batch_sequences):
                    out.extend(self._generate_group(group, stop))
        finally:
            with self._live_lock:
                self._live = None
        return out

    def _running_progress(self) -> list[list[SampleOutput]] | None:
        with self._live_lock:
            return None if self._live is None else self._live.snapshot()

    # -- a group of requests, all their samples as one left-padded batch ----------------------

    def _generate_group(
        self, requests: Sequence[RolloutRequest], stop: threading.Event | None
    ) -> list[list[SampleOutput]]:
        routing = self._routing if any(r.return_routed_experts for r in requests) else None
        if routing is None:
            return self._decode_group(requests, None, stop)
        routing.start(sum(r.sampling_params.n for r in requests))
        try:
            return self._decode_group(requests, routing, stop)
        finally:
            routing.stop()

    def _decode_group(
        self, requests: Sequence[RolloutRequest], routing: RoutingCapture | None, stop: threading.Event | None
    ) -> list[list[SampleOutput]]:
        """Decode every sample of `requests`; when `stop` is set, end at the next step with the
        unfinished samples interrupted (`Finish("abort", message=INTERRUPTED)`, tokens kept)."""
        torch = self._torch
        device = self.device
        rows = SamplingRows(requests, self.hidden_stop_ids, self.vocab_size, torch, device)
        width = max(len(r.input_ids) for r in requests)
        prompt = torch.zeros((rows.count, width), dtype=torch.long, device=device)
        mask = torch.zeros((rows.count, width), dtype=torch.long, device=device)
        for row, request in enumerate(rows.request_of):
            ids = request.input_ids
            prompt[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long, device=device)
            mask[row, width - len(ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt_logprobs = any(r.prompt_logprobs is not None for r in requests)
        adapters = [r.adapter for r in rows.request_of]
        out = self.forward(adapters, input_ids=prompt, attention_mask=mask, position_ids=positions,
                            use_cache=True, logits_to_keep=0 if want_prompt_logprobs else 1)
        prompt_logprobs = [
            self._prompt_logprobs(request, out.logits[rows.first_row[index], width - len(request.input_ids):])
            if request.prompt_logprobs is not None else None
            for index, request in enumerate(requests)
        ]
        logits = out.logits[:, -1, :].float()
        past = out.cache
        if routing is not None:
            routing.step()

        # How often each row generated each token: penalties count generated tokens only, as SGLang's.
        counts = torch.zeros((rows.count, self.vocab_size), dtype=torch.float32, device=device)
        tokens: list[list[int]] = [[] for _ in range(rows.count)]
        logprobs: list[list[float]] = [[] for _ in range(rows.count)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(rows.count)]
        finishes: list[Finish | None] = [None] * rows.count
        max_top = max((r.logprobs or 0) for r in requests)
        last_position = positions[:, -1:]
        live = self._live
        if live is not None:
            with self._live_lock:
                live.group = _LiveGroup(list(requests), rows.first_row, tokens, logprobs, tops, finishes)

        for step in range(max(r.sampling_params.max_new_tokens for r in requests)):
            if stop is not None and stop.is_set():
                finishes[:] = [f or Finish("abort", message=INTERRUPTED) for f in finishes]
                break
            scores = rows.penalise(logits, counts, step)
            step_logprobs = torch.log_softmax(scores / rows.temperature[:, None], dim=-1)
            chosen = rows.sample(scores, step_logprobs)
            chosen_logprobs = step_logprobs.gather(1, chosen[:, None])[:, 0]
            top_values = top_ids = None
            if max_top:
                top_values, top_ids = torch.topk(step_logprobs, max_top, dim=-1)
            chosen_list = chosen.tolist()
            chosen_lp_list = chosen_logprobs.tolist()
            with self._live_lock:  # a step's tokens and finishes at once: a snapshot (`progress`) sees whole steps
                for row in range(rows.count):
                    if finishes[row] is not None:
                        continue
                    request = rows.request_of[row]
                    params = request.sampling_params
                    tokens[row].append(chosen_list[row])
                    logprobs[row].append(chosen_lp_list[row])
                    if request.logprobs and top_ids is not None and top_values is not None:
                        k = request.logprobs
                        tops[row].append(list(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist(),
                                                  strict=True)))
                    finishes[row] = self._check_finish(tokens[row], params, rows.token_stops[row])
            counts.scatter_add_(1, chosen[:, None], torch.ones((rows.count, 1), device=device))
            if all(f is not None for f in finishes):
                break
            mask = torch.cat([mask, torch.ones((rows.count, 1), dtype=mask.dtype, device=device)], dim=1)
            last_position = last_position + 1
            out = self.forward(adapters, input_ids=chosen[:, None], attention_mask=mask,
                                position_ids=last_position, cache=past, use_cache=True)
            logits = out.logits[:, -1, :].float()
            past = out.cache
            if routing is not None:
                routing.step()

        # Routed experts of the positions each sample fed: prompt, then all its tokens but the last.
        routed = (
            routing.finish([len(rows.request_of[row].input_ids) + len(tokens[row]) - 1 for row in range(rows.count)],
                           skip=[width - len(rows.request_of[row].input_ids) for row in range(rows.count)])
            if routing is not None
            else [None] * rows.count
        )
        results: list[list[SampleOutput]] = []
        for index, request in enumerate(requests):
            params = request.sampling_params
            samples = []
            for row in range(rows.first_row[index], rows.first_row[index] + params.n):
                finish = finishes[row] or Finish("length")
                # As SGLang's detokenizer: a matched stop token's text is dropped unless no_stop_trim.
                token_stopped = isinstance(finish.matched, int) and not params.no_stop_trim
                text = self.decode(tokens[row][:-1] if token_stopped else tokens[row], params.skip_special_tokens)
                samples.append(
                    SampleOutput(
                        token_ids=np.asarray(tokens[row], dtype=np.int32),
                        finish=finish,
                        logprobs=np.asarray(logprobs[row], dtype=np.float32) if request.logprobs is not None else None,
                        top_logprobs=tops[row] if request.logprobs else None,
                        prompt_logprobs=prompt_logprobs[index],
                        text=text,
                        routed_experts=routed[row] if request.return_routed_experts else None,
                        routed_experts_start=0,
                        weight_version=self._weight_version,
                    )
                )
            results.append(samples)
        return results

    def _prompt_logprobs(self, request: RolloutRequest, logits: object) -> list[float | None]:
        torch = self._torch
        params = request.sampling_params
        scaled = logits.float() if params.greedy else logits.float() / params.temperature
        lp = torch.log_softmax(scaled[:-1], dim=-1)
        ids = torch.tensor(request.input_ids[1:], device=self.device)
        values = lp.gather(1, ids[:, None])[:, 0].tolist() if len(request.input_ids) > 1 else []
        return [None, *values]

    def _check_finish(self, tokens: list[int], params: SamplingParams, token_stops: frozenset[int]) -> Finish | None:
        """SGLang's order: stop string, then stop token, then length."""
        if len(tokens) < params.min_new_tokens:
            return Finish("length") if len(tokens) >= params.max_new_tokens else None
        if params.stop_strings and self.tokenizer is not None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            tail = text[-(max(len(s) for s in params.stop_strings) + 64) :]
            hits = [(tail.find(s), s) for s in params.stop_strings if s in tail]
            if hits:
                return Finish("stop", matched=min(hits)[1])
        if tokens[-1] in token_stops:
            return Finish("stop", matched=tokens[-1])
        if len(tokens) >= params.max_new_tokens:
            return Finish("length")
        return None


@dataclass
class _LiveGroup:
    """The decode loop's per-row lists of the group it runs (read under the engine's live lock)."""

    requests: list[RolloutRequest]
    first_row: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    tops: list[list[list[tuple[int, float]]]]
    finishes: list[Finish | None]


@dataclass
class _LiveBatch:
    """A running batch: its groups' finished outputs (`done`) and the group being decoded."""

    requests: list[RolloutRequest]
    done: list[list[SampleOutput]]
    group: _LiveGroup | None = None

    def snapshot(self) -> list[list[SampleOutput]]:
        """Every sample so far, shaped as the batch's result: decoded groups' samples as returned, the
        running group's with their tokens (finished ones with their finish), later groups' empty."""
        outputs = [list(samples) for samples in self.done]
        group = self.group
        if group is not None and len(outputs) < len(self.requests) and group.requests[0] is self.requests[len(outputs)]:
            for index, request in enumerate(group.requests):
                samples = []
                for row in range(group.first_row[index], group.first_row[index] + request.sampling_params.n):
                    samples.append(SampleOutput(
                        token_ids=np.asarray(group.tokens[row], dtype=np.int32),
                        finish=group.finishes[row] or Finish("abort", message=INTERRUPTED),
                        logprobs=(np.asarray(group.logprobs[row], dtype=np.float32)
                                  if request.logprobs is not None else None),
                        top_logprobs=list(group.tops[row]) if request.logprobs else None,
                    ))
                outputs.append(samples)
        outputs.extend(interrupted_before_start(self.requests[len(outputs):]))
        return outputs


def _base_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """A state dict (or parameters) of a model peft injected LoRA layers into, under the base model's
    names: `...q_proj.base_layer.weight` as `...q_proj.weight`, the adapters' own tensors left out."""
    if not any(".base_layer." in name for name in tensors):
        return tensors
    return {name.replace(".base_layer.", "."): value for name, value in tensors.items()
            if ".lora_" not in name}


def _groups(requests: Sequence[RolloutRequest], max_sequences: int) -> list[list[RolloutRequest]]:
    """Consecutive requests batched together up to `max_sequences` samples (a larger request alone)."""
    groups: list[list[RolloutRequest]] = []
    size = 0
    for request in requests:
        n = request.sampling_params.n
        if groups and size + n <= max_sequences:
            groups[-1].append(request)
            size += n
        else:
            groups.append([request])
            size = n
    return groups


class SamplingRows:
    """The per-sample (row) sampling parameters of a batch, as tensors, and their vectorised use.

    Each row follows its own request's parameters exactly as SGLang's sampler would for that
    request alone: penalties (from generated tokens) on the raw logits, logprobs from
    log-softmax of the penalised logits over the temperature (plain for greedy rows), then
    top-k, top-p and min-p filtering of the probabilities; each row draws from its own
    generator seeded from (seed, sample index).
    """

    def __init__(self, requests: Sequence[RolloutRequest], hidden_stops: frozenset[int], vocab: int,
                 torch: Any, device: Any) -> None:
        self._torch = torch
        self.request_of: list[RolloutRequest] = []
        self.first_row: list[int] = []
        self.generators: list[Any] = []
        self.token_stops: list[frozenset[int]] = []
        for request in requests:
            params = request.sampling_params
            stops = matched_stop_ids(hidden_stops, params.user_stop_token_ids, ignore_eos=params.ignore_eos)
            self.first_row.append(len(self.request_of))
            for i in range(params.n):
                self.request_of.append(request)
                self.generators.append(torch.Generator(device=device).manual_seed(request_sample_seed(request, i)))
                self.token_stops.append(stops)
        self.count = len(self.request_of)
        every = [r.sampling_params for r in self.request_of]

        def column(values: list[float], dtype: Any = torch.float32) -> Any:
            return torch.tensor(values, dtype=dtype, device=device)

        self.temperature = column([1.0 if p.greedy else p.temperature for p in every])
        self.repetition = column([p.repetition_penalty for p in every])
        self.frequency = column([p.frequency_penalty for p in every])
        self.presence = column([p.presence_penalty for p in every])
        self.min_new_tokens = column([p.min_new_tokens for p in every], torch.long)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in every]
        self.top_k = column(top_k, torch.long)
        self.top_p = column([p.top_p for p in every])
        self.min_p = column([p.min_p for p in every])
        # What every decode step would otherwise work out again from the same parameters.
        self.sampled_rows = [row for row, p in enumerate(every) if not p.greedy]
        self.deepest_top_k = max((k for k in top_k if k < vocab), default=0)  # 0: no row limits top-k
        self.any_repetition = any(p.repetition_penalty != 1.0 for p in every)
        self.any_frequency = any(p.frequency_penalty for p in every)
        self.any_presence = any(p.presence_penalty for p in every)
        self.any_top_p = any(p.top_p < 1.0 for p in every)
        self.any_min_p = any(p.min_p > 0 for p in every)
        # min_new_tokens holds back every stop token, ignore_eos or not (SGLang's min-new-tokens
        # penalizer does not look at ignore_eos).
        self.stop_mask = None
        if any(p.min_new_tokens for p in every):
            self.stop_mask = torch.zeros((self.count, vocab), dtype=torch.bool, device=device)
            for row, p in enumerate(every):
                if p.min_new_tokens:
                    self.stop_mask[row, [t for t in hidden_stops | set(p.user_stop_token_ids) if t < vocab]] = True

    def penalise(self, logits: Any, counts: Any, step: int) -> Any:
        """SGLang's penalties from the tokens each row generated so far (never the prompt's):
        the additive ones first (frequency x count, presence once, min_new_tokens' -inf on stop
        tokens), then repetition scaling (divide positive logits, multiply negative ones)."""
        torch = self._torch
        scores = logits
        if self.any_frequency:
            scores = scores - self.frequency[:, None] * counts
        if self.any_presence:
            scores = scores - self.presence[:, None] * (counts > 0).float()
        if self.stop_mask is not None:
            early = (self.min_new_tokens > step)[:, None] & self.stop_mask
            if bool(early.any()):
                scores = scores.masked_fill(early, float("-inf"))
        if self.any_repetition:
            rep = self.repetition[:, None]
            penalised = torch.where(scores < 0, scores * rep, scores / rep)
            scores = torch.where((counts > 0) & (rep != 1.0), penalised, scores)
        return scores

    def sample(self, scores: Any, logprobs: Any) -> Any:
        """Each row's next token: argmax of the penalised scores for greedy rows, else a draw from
        the filtered distribution with the row's own generator."""
        torch = self._torch
        chosen = torch.argmax(scores, dim=-1)
        if self.sampled_rows:
            probs = self._filtered_probs(logprobs)
            for row in self.sampled_rows:
                chosen[row] = torch.multinomial(probs[row], 1, generator=self.generators[row])[0]
        return chosen

    def _filtered_probs(self, logprobs: Any) -> Any:
        """Probabilities after each row's top-k, top-p and min-p (logprobs are taken before)."""
        torch = self._torch
        probs = logprobs.exp()
        vocab = probs.shape[-1]
        if self.deepest_top_k:
            deepest = self.deepest_top_k
            top = torch.topk(probs, deepest, dim=-1).values  # the k-th largest of every limited row is here
            kth = top.gather(1, (self.top_k.clamp(max=deepest) - 1)[:, None])
            probs = torch.where((self.top_k < vocab)[:, None] & (probs < kth), torch.zeros_like(probs), probs)
        if self.any_top_p:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = ((cumulative - sorted_probs) > self.top_p[:, None]) & (self.top_p < 1.0)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = torch.where(drop, torch.zeros_like(probs), probs)
        if self.any_min_p:
            floor = probs.max(dim=-1, keepdim=True).values * self.min_p[:, None]
            probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
        return probs / probs.sum(dim=-1, keepdim=True)


def _check_model_dir(path: Path) -> None:
    """`EngineUnavailableError` saying what is wrong with a model directory: missing, or no config.json."""
    if not path.exists():
        raise EngineUnavailableError(f"{path} does not exist (as this worker sees it)")
    if not (path / "config.json").exists():
        raise EngineUnavailableError(f"{path} is not a transformers model directory (no config.json)")

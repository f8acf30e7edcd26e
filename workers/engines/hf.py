"""The `hf` engine: transformers on CPU (or GPU), the embedded default and the test engine.

It decodes token by token with a KV cache, so generation really ends at the first stop
(string or token id), and computes logprobs with SGLang's semantics: log-softmax of the
(penalised) logits divided by the temperature, before top-k/top-p/min-p filtering; plain
log-softmax for greedy requests. The `n` samples of a request run as one batch sharing the
prompt; each sample draws from its own generator seeded from (seed, sample index).

For mixture-of-experts models it captures routed experts (`return_routed_experts`) with
forward hooks on the routers (`workers.engines.hf_routing`), in SGLang's layout: start 0,
one row per position fed through the model — every prompt position and every completion
position but the last sampled token, which was never fed — so `prompt + completion - 1` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schemas.request import RolloutRequest, SamplingParams
from schemas.worker_info import Capabilities
from workers.engines.base import EngineDescription, Finish, SampleOutput
from workers.engines.hf_routing import RoutingCapture
from workers.engines.seeds import sample_seed
from workers.errors import EngineUnavailableError, UnsupportedRequestError


class HFEngine:
    """A transformers causal LM loaded once from a local directory."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        max_top_logprobs: int = 0,
        weight_version: int = 0,
        model_name: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self._torch = torch
        path = Path(model_path)
        if not (path / "config.json").exists():
            raise EngineUnavailableError(f"{path} is not a transformers model directory (no config.json)")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.model.eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None
        self.hidden_stop_ids = self._hidden_stop_ids(path, GenerationConfig)
        self.vocab_size = int(self.model.config.vocab_size)
        self._routing = RoutingCapture.attach(self.model)
        self._weight_version = weight_version
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

    def _hidden_stop_ids(self, path: Path, generation_config_cls: type) -> frozenset[int]:
        """The model's own end tokens: generation config EOS ids and the tokenizer's EOS."""
        ids: set[int] = set()
        try:
            eos = generation_config_cls.from_pretrained(path).eos_token_id
        except OSError:
            eos = self.model.config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    @property
    def description(self) -> EngineDescription:
        return self._description

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def update_weights(self, path: str, version: int) -> None:
        """Reload the model from `path` (same architecture and vocabulary); keep the old one on failure."""
        torch = self._torch
        from transformers import AutoModelForCausalLM

        source = Path(path)
        if not (source / "config.json").exists():
            raise EngineUnavailableError(f"{source} is not a transformers model directory (no config.json)")
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
        self._weight_version = version

    def close(self) -> None:
        if self._routing is not None:
            self._routing.remove()
            self._routing = None
        self.model = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        with self._torch.inference_mode():
            return [self._generate_one(request) for request in requests]

    # -- one request, its n samples as one batch -------------------------------------------

    def _generate_one(self, request: RolloutRequest) -> list[SampleOutput]:
        routing = self._routing if request.return_routed_experts else None
        if request.return_routed_experts and routing is None:
            raise UnsupportedRequestError(
                f"request {request.id!r} asks for routed experts; {self._description.model} is not a "
                "mixture-of-experts model"
            )
        if routing is None:
            return self._decode_request(request, None)
        routing.start(request.sampling_params.n)
        try:
            return self._decode_request(request, routing)
        finally:
            routing.stop()

    def _decode_request(self, request: RolloutRequest, routing: RoutingCapture | None) -> list[SampleOutput]:
        torch = self._torch
        params = request.sampling_params
        n = params.n
        prompt = torch.tensor([request.input_ids] * n, dtype=torch.long, device=self.device)
        want_prompt_logprobs = request.prompt_logprobs is not None
        out = self.model(
            input_ids=prompt, use_cache=True, logits_to_keep=0 if want_prompt_logprobs else 1
        )
        prompt_logprobs = self._prompt_logprobs(request, out.logits[0]) if want_prompt_logprobs else None
        logits = out.logits[:, -1, :].float()
        past = out.cache
        if routing is not None:
            routing.step()

        generators = [
            torch.Generator(device=self.device).manual_seed(sample_seed(params.seed, i)) for i in range(n)
        ]
        token_stops = frozenset() if params.ignore_eos else self.hidden_stop_ids | set(params.user_stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        finishes: list[Finish | None] = [None] * n
        counts = torch.zeros((n, self.vocab_size), dtype=torch.float32, device=self.device)
        seen = torch.zeros((n, self.vocab_size), dtype=torch.bool, device=self.device)
        seen[:, prompt[0]] = True

        for step in range(params.max_new_tokens):
            scores = self._penalise(logits, params, counts, seen, step, token_stops)
            if params.greedy:
                step_logprobs = torch.log_softmax(scores, dim=-1)
                chosen = torch.argmax(scores, dim=-1)
            else:
                step_logprobs = torch.log_softmax(scores / params.temperature, dim=-1)
                probs = self._filtered_probs(step_logprobs, params)
                chosen = torch.stack(
                    [torch.multinomial(probs[i], 1, generator=generators[i])[0] for i in range(n)]
                )
            chosen_logprobs = step_logprobs.gather(1, chosen[:, None])[:, 0]
            top_values = top_ids = None
            if request.logprobs:
                top_values, top_ids = torch.topk(step_logprobs, request.logprobs, dim=-1)
            for i in range(n):
                if finishes[i] is not None:
                    continue
                token = int(chosen[i])
                tokens[i].append(token)
                logprobs[i].append(float(chosen_logprobs[i]))
                if top_ids is not None and top_values is not None:
                    tops[i].append(list(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True)))
                finishes[i] = self._check_finish(tokens[i], params, token_stops)
            counts.scatter_add_(1, chosen[:, None], torch.ones((n, 1), device=self.device))
            seen[torch.arange(n), chosen] = True
            if all(f is not None for f in finishes):
                break
            out = self.model(input_ids=chosen[:, None], cache=past, use_cache=True)
            logits = out.logits[:, -1, :].float()
            past = out.cache
            if routing is not None:
                routing.step()

        # Routed experts of the positions each sample fed: prompt, then all its tokens but the last.
        routed = (
            routing.finish([len(request.input_ids) + len(tokens[i]) - 1 for i in range(n)])
            if routing is not None
            else [None] * n
        )
        samples = []
        for i in range(n):
            finish = finishes[i] or Finish("length")
            # As SGLang's detokenizer: a matched stop token's text is dropped unless no_stop_trim.
            token_stopped = isinstance(finish.matched, int) and not params.no_stop_trim
            text = self._decode(tokens[i][:-1] if token_stopped else tokens[i], params)
            samples.append(
                SampleOutput(
                    token_ids=np.asarray(tokens[i], dtype=np.int32),
                    finish=finish,
                    logprobs=np.asarray(logprobs[i], dtype=np.float32) if request.logprobs is not None else None,
                    top_logprobs=tops[i] if request.logprobs else None,
                    prompt_logprobs=prompt_logprobs,
                    text=text,
                    routed_experts=routed[i],
                    routed_experts_start=0,
                    weight_version=self._weight_version,
                )
            )
        return samples

    def _prompt_logprobs(self, request: RolloutRequest, logits: object) -> list[float | None]:
        torch = self._torch
        params = request.sampling_params
        scaled = logits.float() if params.greedy else logits.float() / params.temperature
        lp = torch.log_softmax(scaled[:-1], dim=-1)
        ids = torch.tensor(request.input_ids[1:], device=self.device)
        values = lp.gather(1, ids[:, None])[:, 0].tolist() if len(request.input_ids) > 1 else []
        return [None, *values]

    def _penalise(self, logits, params: SamplingParams, counts, seen, step: int, token_stops):  # type: ignore[no-untyped-def]
        torch = self._torch
        scores = logits
        if params.repetition_penalty != 1.0:
            penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        if params.frequency_penalty:
            scores = scores - params.frequency_penalty * counts
        if params.presence_penalty:
            scores = scores - params.presence_penalty * (counts > 0).float()
        if step < params.min_new_tokens and token_stops:
            scores = scores.clone()
            scores[:, list(token_stops)] = float("-inf")
        return scores

    def _filtered_probs(self, logprobs, params: SamplingParams):  # type: ignore[no-untyped-def]
        """Probabilities after top-k, top-p and min-p filtering (logprobs are taken before)."""
        torch = self._torch
        probs = logprobs.exp()
        if 0 < params.top_k < probs.shape[-1]:
            kth = torch.topk(probs, params.top_k, dim=-1).values[:, -1:]
            probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = (cumulative - sorted_probs) > params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = torch.where(drop, torch.zeros_like(probs), probs)
        if params.min_p > 0:
            floor = probs.max(dim=-1, keepdim=True).values * params.min_p
            probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
        return probs / probs.sum(dim=-1, keepdim=True)

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

    def _decode(self, tokens: list[int], params: SamplingParams) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)

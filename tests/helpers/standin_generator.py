"""The SGLang stand-in's own generator: plain transformers forward passes and SGLang's rules.

Independent of the project's engines (nothing from `workers` is imported): a full forward pass
per token (no KV cache, no batching, no padding), the sampling rules of
`tests.helpers.sampling_reference` (SGLang's penalizers, top-k/top-p/min-p, logprobs), a numpy
generator per sample seeded from `sampling_seed` (a fresh random seed without one, so
unseeded samples differ), and SGLang's finish order from `schedule_batch.update_finish_state`:
stop string (over the decoded text), then stop token or EOS (unless `ignore_eos`), then length.
`min_new_tokens` holds back EOS and stop tokens by their -inf penalty only, as in SGLang.
Its input is SGLang's own normalised `SamplingParams` object (see `tests.helpers.sglang_wheel`).
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers import sampling_reference as ref


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish: dict[str, Any]  # SGLang's finish_reason JSON
    text: str | None


class Generator:
    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.config = self.model.config
        self.vocab_size = int(self.config.vocab_size)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None
        # SGLang's `model_config._get_hf_eos_token_id` (config.json's and generation_config.json's EOS
        # ids, both), then `Req._check_token_based_finish`: the tokenizer's EOS and its additional
        # stop tokens (`hf_transformers/common.py: attach_additional_stop_token_ids`).
        declared = [self.config.eos_token_id]
        with contextlib.suppress(OSError):
            declared.append(GenerationConfig.from_pretrained(path).eos_token_id)
        eos: set[int] = set()
        for ids in declared:
            eos.update([ids] if isinstance(ids, int) else ids or [])
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                eos.add(int(self.tokenizer.eos_token_id))
            added = self.tokenizer.get_added_vocab()
            eos.update(added[t] for t in ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")
                       if t in added)
        self.eos = frozenset(eos)

    def _next_logits(self, ids: list[int]) -> np.ndarray:
        torch = self._torch
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()

    def prompt_logprobs(self, ids: list[int], temperature: float) -> list[float | None]:
        """Each prompt token's logprob given the tokens before it (the first has none)."""
        torch = self._torch
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
        out: list[float | None] = [None]
        for position in range(1, len(ids)):
            row = logits[position - 1]
            out.append(float(ref.log_softmax(row / temperature)[ids[position]]))
        return out

    def generate(self, prompt: list[int], sp: Any, *, top_logprobs: int = 0) -> Sample:
        """One sample for SGLang's normalised `SamplingParams` `sp` (temperature 0 arrives as
        top_k 1 and temperature 1; top_k -1 as 1 << 30)."""
        greedy = sp.top_k == 1
        rule = ref.Rule(
            temperature=0.0 if greedy else sp.temperature,
            top_k=-1 if sp.top_k >= self.vocab_size else sp.top_k,
            top_p=sp.top_p, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
            min_new_tokens=sp.min_new_tokens,
        )
        rng = np.random.default_rng(sp.sampling_seed if sp.sampling_seed is not None else secrets.randbits(63))
        user_stops = set(sp.stop_token_ids or ())
        stops = self.eos | user_stops
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        finish: dict[str, Any] = {"type": "length", "length": sp.max_new_tokens}
        while len(tokens) < sp.max_new_tokens:
            scores = ref.penalised(self._next_logits(prompt + tokens), tokens, rule, stops)
            lps = ref.logprobs(scores, rule)
            if greedy:
                token = int(np.argmax(scores))
            else:
                allowed = sorted(ref.allowed(scores, rule))
                weights = np.exp(lps[allowed])
                token = int(rng.choice(allowed, p=weights / weights.sum()))
            tokens.append(token)
            logprobs.append(float(lps[token]))
            if top_logprobs:
                best = np.argsort(-lps, kind="stable")[:top_logprobs]
                top.append([(int(t), float(lps[t])) for t in best])
            matched_str = self._stop_string(tokens, sp.stop_strs)
            if matched_str is not None:
                finish = {"type": "stop", "matched": matched_str}
                break
            if not sp.ignore_eos and token in stops:
                finish = {"type": "stop", "matched": token}
                break
        return Sample(tokens, logprobs, top, finish, self._text(tokens, finish, sp))

    def _stop_string(self, tokens: list[int], stop_strs: list[str]) -> str | None:
        if not stop_strs or self.tokenizer is None:
            return None
        text = self.tokenizer.decode(tokens)
        return next((s for s in stop_strs if s in text), None)

    def _text(self, tokens: list[int], finish: dict[str, Any], sp: Any) -> str | None:
        """`detokenizer_manager.trim_matched_stop`: cut before a matched string (after it with
        `no_stop_trim`), drop a matched stop token's text unless `no_stop_trim`."""
        if self.tokenizer is None:
            return None
        matched = finish.get("matched")
        if isinstance(matched, int) and not sp.no_stop_trim:
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=sp.skip_special_tokens)
        if isinstance(matched, str):
            position = text.find(matched)
            if position >= 0:
                text = text[: position + len(matched)] if sp.no_stop_trim else text[:position]
        return text

"""The hf engine's sampling against an independent reference of SGLang's rules.

Every token the engine produced is checked against `tests.helpers.sampling_reference`, fed with
logits from a separate teacher-forced forward pass (no KV cache, one sequence, float64 maths):
a greedy token is the reference's argmax after penalties, a sampled token lies in the set that
top-k, top-p and min-p leave, and each stored logprob is the reference's. On the demo model
(SmolLM2, peaked distributions) the filters and penalties visibly change what may be drawn; the
tiny random model covers a small vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from schemas.request import RolloutRequest, SamplingParams
from tests.helpers import sampling_reference as ref
from workers.engines.base import SampleOutput
from workers.engines.hf.engine import HFEngine

LOGPROB_ATOL = 1e-4  # a KV-cached decode against a full forward pass, float32
MASS_SLACK = 1e-5  # probability mass by which a filter boundary may be missed through rounding
TIE = 1e-4  # greedy: logits this close to the maximum count as ties

PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "def fibonacci(n):\n"]
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3}

SAMPLED = [
    {"temperature": 0.8, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 1.3, "min_p": 0.1},
    {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "min_new_tokens": 6, **PENALTIES},
    {"temperature": 1.1, "top_p": 0.8, "repetition_penalty": 1.6},
    {"temperature": 0.7},
]
GREEDY = [
    {"temperature": 0.0, **PENALTIES},
    {"temperature": 0.0, "repetition_penalty": 1.8},
    {"temperature": 0.0, "frequency_penalty": 1.5, "min_new_tokens": 10},
    {"temperature": 0.0, "presence_penalty": -1.0},
]


@dataclass
class Model:
    path: Path
    engine: HFEngine
    net: torch.nn.Module
    eos: frozenset[int]
    encode: object
    vocab: int = field(init=False)

    def __post_init__(self) -> None:
        self.vocab = int(self.net.config.vocab_size)


def load(path: Path, encode: object) -> Model:
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Model(path, HFEngine(path, max_top_logprobs=5), net, frozenset(ids), encode)


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> Model:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return load(demo_model_dir, lambda text: tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Model:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return load(tiny_model_dir, lambda text: tokenizer(text)["input_ids"])


def rule_of(params: SamplingParams) -> ref.Rule:
    return ref.Rule(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty, min_new_tokens=params.min_new_tokens,
    )


def teacher_forced_logits(net: torch.nn.Module, sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """For each (prompt, completion), the logits that predicted each completion token: one full
    forward pass of the right-padded sequences (causal attention: padding after a position
    cannot change it)."""
    width = max(len(p) + len(c) for p, c in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(sequences):
        ids[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
    with torch.no_grad():
        logits = net(input_ids=ids).logits.double()
    return [logits[row, len(p) - 1 : len(p) + len(c) - 1].numpy() for row, (p, c) in enumerate(sequences)]


@dataclass
class Visible:
    """Steps where the rule mattered: penalties moved a greedy argmax, or filters dropped tokens
    that held real probability (so the checks could have failed)."""

    steps: int = 0
    cut: int = 0


def check(model: Model, outputs: list[tuple[RolloutRequest, list[SampleOutput]]]) -> dict[str, Visible]:
    """Every token of every sample against the reference; how visible the filters were, per request."""
    pairs = [(request, sample) for request, samples in outputs for sample in samples]
    all_logits = teacher_forced_logits(model.net, [(r.input_ids, s.token_ids.tolist()) for r, s in pairs])
    visible: dict[str, Visible] = {}
    for (request, sample), logits in zip(pairs, all_logits, strict=True):
        params = request.sampling_params
        rule = rule_of(params)
        stops = model.eos | set(params.user_stop_token_ids)
        tokens = sample.token_ids.tolist()
        assert sample.logprobs is not None and len(sample.logprobs) == len(tokens)
        seen = visible.setdefault(request.id, Visible())
        for step, token in enumerate(tokens):
            scores = ref.penalised(logits[step], tokens[:step], rule, stops)
            expected = ref.logprobs(scores, rule)
            where = f"request {request.id}, {params.model_dump(exclude_defaults=True)}, step {step}"
            assert token in ref.allowed(scores, rule, slack=TIE if rule.greedy else MASS_SLACK), (
                f"{where}: token {token} is outside what the reference allows"
            )
            assert float(sample.logprobs[step]) == pytest.approx(expected[token], abs=LOGPROB_ATOL), where
            if request.logprobs and sample.top_logprobs is not None:
                top = sample.top_logprobs[step]
                reference_top = np.sort(expected)[::-1][: len(top)]
                np.testing.assert_allclose([lp for _, lp in top], reference_top, atol=LOGPROB_ATOL, err_msg=where)
            seen.steps += 1
            if rule.greedy:  # the penalties moved the argmax
                seen.cut += int(np.argmax(scores)) != int(np.argmax(logits[step]))
            else:  # the filters dropped tokens that held real probability
                probable = {int(t) for t in np.flatnonzero(np.exp(expected) > 1e-3)}
                seen.cut += bool(probable - ref.allowed(scores, rule))
    return visible


def requests_for(model: Model, rules: list[dict], *, n: int, max_new_tokens: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(id=f"p{p}r{r}", input_ids=model.encode(prompt), logprobs=3 if r == 0 else 0,
                       sampling_params={**rule, "n": 1 if rule["temperature"] == 0 else n, "seed": 100 * p + r,
                                        "max_new_tokens": max_new_tokens})
        for p, prompt in enumerate(PROMPTS) for r, rule in enumerate(rules)
    ]


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_greedy_with_penalties_follows_the_reference_step_by_step(which: str, request: pytest.FixtureRequest) -> None:
    model: Model = request.getfixturevalue(which)
    requests = requests_for(model, GREEDY, n=1, max_new_tokens=16)
    outputs = model.engine.generate(requests)
    visible = check(model, list(zip(requests, outputs, strict=True)))
    # The penalties moved the argmax at some step for every rule but the negative presence penalty
    # (which favours repeats, so it seldom moves a peaked argmax).
    moved = {r: sum(v.cut for key, v in visible.items() if key.endswith(f"r{r}")) for r in range(len(GREEDY))}
    assert all(moved[r] > 0 for r in range(len(GREEDY) - 1)), moved


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_sampled_tokens_lie_in_the_reference_set_with_its_logprobs(which: str, request: pytest.FixtureRequest) -> None:
    model: Model = request.getfixturevalue(which)
    requests = requests_for(model, SAMPLED, n=2, max_new_tokens=16)
    outputs = model.engine.generate(requests)  # one batch: every row keeps its own parameters
    assert [len(samples) for samples in outputs] == [r.sampling_params.n for r in requests]
    visible = check(model, list(zip(requests, outputs, strict=True)))
    # Each filtering rule cut tokens that held real probability at some step, so membership is a
    # real check; the unfiltered rule (the last) never does.
    cut = {r: sum(v.cut for key, v in visible.items() if key.endswith(f"r{r}")) for r in range(len(SAMPLED))}
    assert all(cut[r] > 0 for r in range(len(SAMPLED) - 1)), cut
    assert cut[len(SAMPLED) - 1] == 0


def test_min_new_tokens_holds_back_eos_even_with_ignore_eos(scripted_model_dir: Path) -> None:
    """SGLang's min-new-tokens penalizer masks the stop tokens whether or not ignore_eos is set:
    the scripted model says "h" -> "e" -> EOS, and EOS may not come before the fifth token."""
    tokenizer = AutoTokenizer.from_pretrained(scripted_model_dir)
    scripted = load(scripted_model_dir, lambda text: tokenizer(text)["input_ids"])
    request = RolloutRequest(id="r", input_ids=scripted.encode("h"), logprobs=0,
                             sampling_params={"temperature": 0, "min_new_tokens": 5, "max_new_tokens": 8,
                                              "ignore_eos": True})
    sample = scripted.engine.generate([request])[0][0]
    check(scripted, [(request, [sample])])
    assert not set(sample.token_ids[:5].tolist()) & scripted.eos

"""The hf engine: logprobs equal a teacher-forced recomputation; seeds reproduce samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.request import RolloutRequest
from workers.engines.hf.engine import HFEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngine:
    return HFEngine(tiny_model_dir, max_top_logprobs=5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def teacher_forced(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> np.ndarray:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    scaled = logits if temperature < 1e-6 else logits / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logprobs[positions, torch.tensor(completion)].numpy()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.8},
        {"temperature": 1.3, "top_k": 5, "min_p": 0.05},
        {"temperature": 0.0},
    ],
)
def test_logprobs_match_teacher_forcing(engine: HFEngine, reference: torch.nn.Module, params: dict) -> None:
    request = RolloutRequest(
        id="r", input_ids=[5, 9, 13, 2], sampling_params={**params, "max_new_tokens": 24, "n": 3, "seed": 11,
                                                          "ignore_eos": True},
        prompt_logprobs=0,
    )
    samples = engine.generate([request])[0]
    assert len(samples) == 3
    for sample in samples:
        tokens = sample.token_ids.tolist()
        assert len(tokens) == 24 == len(sample.logprobs)
        expected = teacher_forced(reference, request.input_ids, tokens, params["temperature"])
        np.testing.assert_allclose(sample.logprobs, expected, atol=2e-5, rtol=1e-5)
        # Prompt logprobs: one per prompt token, position 0 null, same semantics.
        assert sample.prompt_logprobs is not None and sample.prompt_logprobs[0] is None
        prompt_expected = teacher_forced(reference, request.input_ids[:1], request.input_ids[1:], params["temperature"])
        np.testing.assert_allclose(sample.prompt_logprobs[1:], prompt_expected, atol=2e-5)


def test_same_seed_same_tokens_different_seed_different_tokens(engine: HFEngine) -> None:
    def run(seed: int) -> list[list[int]]:
        request = RolloutRequest(id="r", input_ids=[3, 4], sampling_params={"max_new_tokens": 16, "n": 2, "seed": seed,
                                                                              "ignore_eos": True})
        return [s.token_ids.tolist() for s in engine.generate([request])[0]]

    first = run(7)
    assert run(7) == first
    assert first[0] != first[1], "samples of one request must differ"
    assert run(8) != first


def test_top_logprobs_sorted_and_contain_the_chosen_token(engine: HFEngine) -> None:
    request = RolloutRequest(id="r", input_ids=[1], logprobs=5,
                             sampling_params={"max_new_tokens": 12, "seed": 1, "ignore_eos": True})
    sample = engine.generate([request])[0][0]
    assert sample.top_logprobs is not None and len(sample.top_logprobs) == 12
    for token, logprob, alternatives in zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True):
        values = [lp for _, lp in alternatives]
        assert len(alternatives) == 5 and values == sorted(values, reverse=True)
        ids = [t for t, _ in alternatives]
        if token in ids:
            assert values[ids.index(token)] == pytest.approx(float(logprob), abs=1e-6)
        else:
            assert logprob <= values[-1] + 1e-6


def test_greedy_is_argmax(engine: HFEngine, reference: torch.nn.Module) -> None:
    request = RolloutRequest(id="r", input_ids=[7, 8], sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                         "ignore_eos": True})
    tokens = engine.generate([request])[0][0].token_ids.tolist()
    ids = [7, 8]
    for token in tokens:
        with torch.no_grad():
            assert int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == token
        ids.append(token)


BATCH = [
    RolloutRequest(id="a", input_ids=[5, 9, 13, 2, 7, 7, 1], logprobs=3, prompt_logprobs=0,
                   sampling_params={"temperature": 0.8, "top_p": 0.9, "n": 2, "seed": 1, "max_new_tokens": 10}),
    RolloutRequest(id="b", input_ids=[4], sampling_params={"temperature": 0, "max_new_tokens": 6}),
    RolloutRequest(id="c", input_ids=[11, 3, 8], logprobs=1,
                   sampling_params={"temperature": 1.2, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.3,
                                    "frequency_penalty": 0.4, "presence_penalty": 0.2, "n": 3, "seed": 5,
                                    "max_new_tokens": 12, "min_new_tokens": 4, "stop_token_ids": [3, 8]}),
    RolloutRequest(id="d", input_ids=[2, 2], sampling_params={"seed": 9, "max_new_tokens": 3, "ignore_eos": True}),
]


@pytest.mark.parametrize("max_batch", [64, 3])
def test_a_batch_of_requests_decodes_as_each_request_alone(tiny_model_dir: Path, engine: HFEngine,
                                                           max_batch: int) -> None:
    """Requests batched together (left-padded prompts, each row with its own parameters and
    generator) give each request what it gets alone: the same tokens, finishes and texts, and
    logprobs equal up to the rounding of a batched matmul."""
    batched = HFEngine(tiny_model_dir, max_top_logprobs=5, max_batch_sequences=max_batch).generate(BATCH)
    alone = [engine.generate([request])[0] for request in BATCH]
    assert [len(samples) for samples in batched] == [r.sampling_params.n for r in BATCH]
    for request, ours, theirs in zip(BATCH, batched, alone, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids.tolist() == b.token_ids.tolist(), request.id
            assert (a.finish, a.text) == (b.finish, b.text)
            if request.logprobs is None:
                assert a.logprobs is None and b.logprobs is None
            else:
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
            if request.logprobs:
                assert [[t for t, _ in step] for step in a.top_logprobs] == [[t for t, _ in s] for s in b.top_logprobs]
            if request.prompt_logprobs is not None:
                assert a.prompt_logprobs[0] is None
                np.testing.assert_allclose(a.prompt_logprobs[1:], b.prompt_logprobs[1:], atol=2e-5)
    # min_new_tokens held back request c's stop tokens for its first 4 tokens.
    for sample in batched[2]:
        assert not set(sample.token_ids[:4].tolist()) & {3, 8}


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3}


def test_penalties_count_generated_tokens_only_not_the_prompt(demo_model_dir: Path) -> None:
    """SGLang's penalizers start from zero generated tokens: the first token of a penalised greedy
    request is the model's own argmax and its logprob the plain log-softmax, however often the
    prompt repeats that token (a prompt-seeded penalty makes SmolLM2 leave the count here)."""
    engine = HFEngine(demo_model_dir)
    prompt = engine.tokenizer(COUNTING)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        first = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    expected = int(first.argmax())
    assert expected in prompt, "the test needs a first token the prompt already contains"
    request = RolloutRequest(id="r", input_ids=prompt, logprobs=0,
                             sampling_params={"temperature": 0, "max_new_tokens": 2, **PENALTIES})
    sample = engine.generate([request])[0][0]
    assert int(sample.token_ids[0]) == expected
    assert float(sample.logprobs[0]) == pytest.approx(float(first[expected]), abs=1e-4)

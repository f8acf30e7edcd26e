"""Chat lines end to end: a JSONL of messages → rows whose prompt ids are the parity fixture's ids;
a two-turn conversation continued from a row keeps the first turn's sampled ids byte-identical.

A random tiny Llama carries the tiny-tools fixture tokenizer, served by an in-process burst
`RolloutWorker` with the hf engine, against the session's real redis-server.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

import pipeline
from pipeline.cli.main import main as cli_main
from pipeline.core.errors import RequestFileError
from pipeline.submit.render import ChatRenderer
from schemas.request import RolloutRequest
from workers.engines.hf.engine import HFEngine
from workers.process.worker import RolloutWorker

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TOKENIZER = FIXTURES / "tokenizers" / "tiny-tools"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, path / name)
    renderer = ChatRenderer(path)
    vocab, eos = len(renderer.tokenizer), renderer.tokenizer.eos_token_id
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None, pad_token_id=eos)
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(eos_token_id=[eos], bos_token_id=None, pad_token_id=eos).save_pretrained(path)
    return path


def _fixture_cases() -> list[dict[str, Any]]:
    cases = json.loads((FIXTURES / "parity" / "tiny-tools.json").read_text())["cases"]
    return [c for c in cases if "expected" in c and "known_gap" not in c]


def _work(redis_client: redis.Redis, model: Path) -> None:
    RolloutWorker(redis_client, HFEngine(model)).work(burst=True, with_scheduler=False, logging_level="WARNING")


def test_messages_jsonl_to_rows(chat_model_dir: Path, redis_url: str, redis_client: redis.Redis,
                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = _fixture_cases()
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({**c["request"], "id": c["name"]}) + "\n" for c in cases))
    code = cli_main(["submit", str(jsonl), "--redis", redis_url, "--tokenizer", str(chat_model_dir),
                     "--run", "chat", "--output", f"file://{tmp_path / 'out'}"])
    assert code == 0, capsys.readouterr().err
    _work(redis_client, chat_model_dir)
    table = pipeline.read_rollouts(f"file://{tmp_path / 'out' / 'chat'}")
    rows = {r["request_id"]: r for r in table.to_pylist()}
    assert set(rows) == {c["name"] for c in cases}
    for case in cases:
        row = rows[case["name"]]
        assert row["prompt_token_ids"] == case["expected"]["token_ids"], case["name"]
        assert row["prompt_text"] == case["expected"]["prompt_text"]


def test_submit_errors_name_line_and_field(chat_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    jsonl = tmp_path / "bad.jsonl"
    lines = [{"id": "ok", "messages": [{"role": "user", "content": "hi"}]},
             {"id": "bad", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
             {"id": "typo", "messages": [{"role": "user", "contnet": "hi"}]}]
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = pipeline.connect(redis_url)
    with pytest.raises(RequestFileError) as info:
        client.submit_file(str(jsonl), tokenizer=chat_model_dir)
    text = str(info.value)
    assert "bad.jsonl:2: tool_choice: Tools cannot be empty if tool choice is set to required." in text
    assert "bad.jsonl:3: messages[0].contnet: unknown field" in text


def test_two_turns_keep_sampled_ids(chat_model_dir: Path, redis_url: str, redis_client: redis.Redis,
                                    tmp_path: Path) -> None:
    client = pipeline.connect(redis_url)
    renderer = ChatRenderer(chat_model_dir)
    tok = renderer.tokenizer
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 3}
    output = f"file://{tmp_path / 'out'}"
    turn1 = client.submit([{"id": "t1", "messages": first, "sampling_params": params}], run="turn1",
                          output=output, tokenizer=renderer)
    _work(redis_client, chat_model_dir)
    [row] = turn1.read().to_pylist()
    prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
    assert completion, "the first turn sampled nothing"
    # The reply as the template should render it: the sampled text without its closing EOS.
    reply_ids = completion[:-1] if completion[-1] == tok.eos_token_id else completion
    reply = tok.decode(reply_ids, skip_special_tokens=False)
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]
    turn2 = client.submit([{"id": "t2", "messages": second, "sampling_params": params,
                            "continue_from": {"prompt_token_ids": prompt, "completion_token_ids": completion}}],
                          run="turn2", output=output, tokenizer=renderer)
    _work(redis_client, chat_model_dir)
    [row2] = turn2.read().to_pylist()
    ids2 = row2["prompt_token_ids"]
    kept = len(prompt) + len(completion)
    assert ids2[:kept] == prompt + completion  # byte-identical: never re-tokenized
    assert row2["prompt_text"] == renderer.render_line(
        {"id": "x", "messages": second})["prompt_text"]  # the text is the whole conversation's rendering
    assert tok.decode(ids2[kept:], skip_special_tokens=False).endswith("<|user|>And tomorrow?<|end|>\n<|assistant|>")


def test_a_chat_line_keeps_its_routing_key_and_a_bad_one_is_named(chat_model_dir: Path) -> None:
    """A chat line can pin its sessions to one server behind a gateway, as a token-id line can
    (`routing_key`, docs/engines.md); the key goes through rendering as it was, checked as the request's."""
    renderer = ChatRenderer(chat_model_dir)
    line = {"id": "s1", "messages": [{"role": "user", "content": "hi"}], "routing_key": "session-7"}
    rendered = renderer.render_line(line)
    assert isinstance(rendered, dict) and rendered["routing_key"] == "session-7" and rendered["input_ids"]
    assert RolloutRequest.model_validate(rendered).routing_key == "session-7"
    with pytest.raises(ValidationError, match="routing_key"):
        renderer.render_line({**line, "routing_key": "has space"})

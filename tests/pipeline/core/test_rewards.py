"""Reward functions: the registry (built-ins, `$PIPELINE_REWARDS`), the built-ins' verdicts, the
return-value checks, and a submit naming an unregistered function (refused, nothing enqueued)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core import errors, rewards
from pipeline.core.broker import keys
from pipeline.core.jobs.queue import rollout_queue


def row(text: str | None, answer: object = None) -> dict:
    return {"rollout_id": "r-0", "request_id": "r", "sample_index": 0, "completion_text": text,
            "completion_token_ids": [1, 2], "finish_reason": "stop",
            "metadata": {} if answer is None else {"answer": answer}}


def test_exact_match_compares_stripped_text_with_the_answer() -> None:
    assert rewards.exact_match([row(" Paris\n", "Paris"), row("paris", "Paris"), row("Paris.", "Paris")]) == [
        1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request 'r' has no metadata 'answer'"):
        rewards.exact_match([row("Paris")])
    with pytest.raises(ValueError, match="no completion_text"):
        rewards.exact_match([row(None, "Paris")])


def test_numeric_match_takes_the_boxed_or_last_number() -> None:
    got = rewards.numeric_match([
        row("so 3 + 4 = 7", 7), row(r"first 12, then \boxed{1,234.0} and 5", "1234"), row("no number here", 3),
        row("x = -2.50", -2.5), row("7.0000001", 7),
    ])
    assert [r for r, _ in got] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert got[1][1] == {"extracted": 1234.0} and got[2][1] == {"extracted": None}
    with pytest.raises(ValueError, match="'answer' is not a number"):
        rewards.numeric_match([row("3", "three")])


def test_numeric_match_reads_a_dash_between_digits_as_a_range_not_a_minus() -> None:
    got = rewards.numeric_match([row("a 0-3", 3), row("a 0-3", -3), row("pages 10-12, so -4", -4), row("2-1=1", 1)])
    assert [(r, info["extracted"]) for r, info in got] == [(1.0, 3.0), (0.0, 3.0), (1.0, -4.0), (1.0, 1.0)]


def test_only_registered_names_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rewards.ENV_REWARDS, raising=False)
    assert {"exact_match", "numeric_match"} <= set(rewards.registered())
    with pytest.raises(errors.RewardNameError, match=r"'tests\.helpers\.reward_functions:length' is not registered"):
        rewards.resolve("tests.helpers.reward_functions:length")  # an import path is never a name
    monkeypatch.setenv(rewards.ENV_REWARDS, "length=tests.helpers.reward_functions:length, "
                                            "other=tests.helpers.reward_functions:broken")
    assert rewards.resolve("length")([row("ab")]) == [(2.0, {"request": "r"})]
    assert "other" in rewards.registered()
    monkeypatch.setenv(rewards.ENV_REWARDS, "length")
    with pytest.raises(errors.RewardNameError, match="'length' is not name=module:function"):
        rewards.registered()


def test_a_return_value_of_the_wrong_shape_is_named() -> None:
    assert rewards.normalise("f", 2, [1, (0.5, {"a": 1})]) == [(1.0, None), (0.5, {"a": 1})]
    with pytest.raises(ValueError, match="returned 1 for 2 rows"):
        rewards.normalise("f", 2, [1.0])
    with pytest.raises(ValueError, match="row 0: reward nan is not a finite number"):
        rewards.normalise("f", 1, [float("nan")])
    with pytest.raises(ValueError, match="row 0: reward 'x' is not a finite number"):
        rewards.normalise("f", 1, ["x"])


def test_a_submit_naming_an_unregistered_reward_is_refused(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    with pytest.raises(errors.RewardNameError, match="reward function 'os:system' is not registered"):
        client.submit([{"id": "a", "input_ids": [1]}], run="r", output=f"file://{tmp_path}", reward="os:system")
    assert rollout_queue(redis_client).count == 0
    assert redis_client.smembers(keys.run_batches("r")) == set()
    assert redis_client.smembers(keys.REWARD_RUNS) == set()

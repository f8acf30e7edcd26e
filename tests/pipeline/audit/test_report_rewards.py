"""`pipeline report`'s rewards section: mean reward per step (submitted batch) and per weight version,
checked against means computed here from the rows and rewards read back."""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import redis

import pipeline
from pipeline.audit.report_rewards import TITLE
from pipeline.core.broker import control_channel
from schemas.request import RolloutRequest
from schemas.shard import rewards_path
from tests.helpers.reward_functions import length
from tests.pipeline.audit.test_report import Page, assert_self_contained
from tests.workers.rewards.test_reward_worker import generate  # a burst sim worker: every queued job
from workers.engines.base import Finish, SampleOutput
from workers.rewards.reward_worker import RewardWorker, score
from workers.rows.shard_writer import PendingShard, encode, write_shard
from workers.rows.table import RowContext, build_table


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REWARDS", "length=tests.helpers.reward_functions:length")


def requests(prefix: str, tokens: list[int]) -> list[dict]:
    """One request per length, 2 samples each (a GRPO group); the sim engine samples that many tokens."""
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n, "n": 2}}
            for i, n in enumerate(tokens)]


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values)


def test_mean_reward_per_step_and_per_version_of_a_run(redis_client: redis.Redis, tmp_path: Path) -> None:
    """Three batches scored by a reward worker (v0, v0, then v1 after a push) and a held-out-like batch
    without a reward function in between: three steps in submit order, two versions, the plain rows
    left out and counted."""
    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    first = client.submit(requests("a", [3, 5, 8]), run="r", output=output, batch_size=2, reward="length")
    plain = client.submit(requests("h", [4, 4]), run="r", output=output)
    second = client.submit(requests("b", [2, 9]), run="r", output=output, reward="length")
    generate(redis_client)
    control_channel.push_weights(redis_client, "/ckpt/v1", 1, mode="drain")  # no live worker: the next one loads it
    third = client.submit(requests("c", [6, 7, 1, 12]), run="r", output=output, batch_size=3, reward="length")
    generate(redis_client)
    assert RewardWorker(redis_client, block_ms=50).work(burst=True) == 5  # 2 + 1 + 2 jobs scored

    rows = pipeline.read_rollouts(output, "r", conn=redis_client, rewards=True).to_pylist()
    steps = [[r["reward"] for r in rows if r["job_id"] in batch.job_ids] for batch in (first, second, third)]
    by_version: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if row["reward"] is not None:
            by_version[row["weight_version"]].append(row["reward"])
    assert sorted(by_version) == [0, 1] and all(len(s) > 1 for s in steps)  # what the section must show

    text = pipeline.report("r", conn=redis_client)
    page = Page(text)
    assert_self_contained(page)
    assert page.titles[0] == TITLE
    shown = page.table_with("step")
    assert [line["step"] for line in shown] == ["0", "1", "2"]
    assert [line["batch"] for line in shown] == [b.plan.batch_id for b in (first, second, third)]
    assert [line["versions"] for line in shown] == ["v0", "v0", "v1"]
    for line, rewards in zip(shown, steps, strict=True):
        mean, std = spread(rewards)
        assert int(line["rows"]) == len(rewards)
        assert float(line["mean reward"]) == pytest.approx(mean, rel=1e-3)
        assert float(line["std"]) == pytest.approx(std, rel=1e-3)
    versions = page.table_with("continued rows")
    assert [line["version"] for line in versions] == ["v0", "v1"]
    for line, version in zip(versions, (0, 1), strict=True):
        mean, std = spread(by_version[version])
        assert (int(line["rows"]), line["continued rows"]) == (len(by_version[version]), "0")
        assert float(line["mean reward"]) == pytest.approx(mean, rel=1e-3)
        assert float(line["std"]) == pytest.approx(std, rel=1e-3)
    assert plain.status().counts["finished"] == 1
    assert "4 row(s) have no reward" in text  # the plain batch's 2 requests x 2 samples

    by_url = Page(pipeline.report(f"{output}/r"))  # no Redis: the rewards shards beside the shards
    assert by_url.table_with("step") == shown


def test_a_run_without_rewards_has_no_rewards_section(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    client.submit(requests("a", [3, 5]), run="plain", output=f"file://{tmp_path}")
    generate(redis_client)
    page = Page(pipeline.report("plain", conn=redis_client))
    assert TITLE not in page.titles and page.titles[0] == "Completion length per weight version"


def continued_shard(out: Path, job_id: str, submitted: float, samples: list[tuple[int, list[tuple[int, int]]]]) -> str:
    """A shard (through the workers' row builder) of one request whose samples have `tokens` tokens
    each, from the version segments given ((start, version) runs; one run: a single version), and the
    rewards shard beside it as the reward worker scores and writes it (`length`)."""
    request = RolloutRequest.model_validate({"id": job_id, "input_ids": [1, 2], "logprobs": 0,
                                             "sampling_params": {"max_new_tokens": 64, "n": len(samples)}})
    outputs = [SampleOutput(token_ids=np.arange(1, n + 1, dtype=np.int32), finish=Finish("length"),
                            logprobs=np.full(n, -1.0, np.float32), weight_version=segments[-1][1],
                            version_segments=segments if len(segments) > 1 else None) for n, segments in samples]
    at = datetime.fromtimestamp(submitted, UTC)
    ctx = RowContext(run="swap", job_id=job_id, engine="sim", model="m", worker_id="w",
                     weight_version=samples[0][1][0][1], submitted_at=at, started_at=at, finished_at=at)
    url = write_shard(build_table([request], [outputs], ctx), f"file://{out}", "swap", job_id)
    PendingShard(rewards_path(url), encode(score("length", length, url, 256).table)).store()
    return url


def test_a_row_continued_across_a_swap_counts_under_its_last_tokens_version(tmp_path: Path) -> None:
    """Batch `zz` (submitted first) has rows of v0, and rows begun on v0 and finished on v1; batch `aa`
    (submitted later) rows of v1 and one begun on v1 and finished on v2: steps follow submit time,
    not batch ids, and each row counts under the version that finished it."""
    t0 = 1_700_000_000.0
    continued_shard(tmp_path, "zz-00000", t0, [(4, [(0, 0)]), (10, [(0, 0), (6, 1)])])
    continued_shard(tmp_path, "zz-00001", t0, [(8, [(0, 0), (3, 1)]), (2, [(0, 0)])])
    continued_shard(tmp_path, "aa-00000", t0 + 60, [(5, [(0, 1)]), (12, [(0, 1), (4, 2)]), (7, [(0, 1)])])
    rows = pipeline.read_rollouts(f"{tmp_path}/swap", rewards=True).to_pylist()
    assert sorted(r["weight_version"] for r in rows) == [0, 0, 0, 0, 1, 1, 1]  # the oldest token's version

    page = Page(pipeline.report(f"{tmp_path}/swap"))
    steps = page.table_with("step")
    assert [(s["batch"], s["rows"], s["versions"]) for s in steps] == [("zz", "4", "v0, v1"), ("aa", "3", "v1, v2")]
    assert [float(s["mean reward"]) for s in steps] == pytest.approx([(4 + 10 + 8 + 2) / 4, (5 + 12 + 7) / 3])
    versions = {v["version"]: v for v in page.table_with("continued rows")}
    assert {k: (v["rows"], v["continued rows"]) for k, v in versions.items()} == {
        "v0": ("2", "0"), "v1": ("4", "2"), "v2": ("1", "1")}
    assert [float(versions[k]["mean reward"]) for k in ("v0", "v1", "v2")] == pytest.approx(
        [(4 + 2) / 2, (10 + 8 + 5 + 7) / 4, 12])
    assert versions["v2"]["std"] == "—"  # one row: no spread

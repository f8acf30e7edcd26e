"""`pipeline verify`: stored logprobs of real runs recomputed teacher-forced, per weight version.

Runs are real: requests submitted to the test Redis, an in-process worker around the hf engine
writing Parquet shards. The same weights must agree to float rounding (batched vs teacher-forced
forwards), other weights must fail the gate, hostile shards are refused with the row named.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

import pipeline
from tests.conftest import PIPELINE
from tests.helpers.models import build_random_moe_model, token_id
from tests.workers.rows.test_partial_swap import CountingHF, run_with_push
from workers.audit.recompute import parse_models
from workers.engines.hf.engine import HFEngine
from workers.process.worker import RolloutWorker

SAME_WEIGHTS = 1e-3  # the bound for shards made with the checked weights

REQUESTS = [
    {"id": "hot", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 24, "n": 2, "seed": 3}},
    {"id": "warm", "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 24, "temperature": 0.7,
                                                                   "top_k": 20, "top_p": 0.9, "seed": 5}},
    {"id": "greedy", "input_ids": [9, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    {"id": "penalised", "input_ids": [11, 12], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0.8, "seed": 7, "frequency_penalty": 0.6, "presence_penalty": 0.4,
        "repetition_penalty": 1.3}},
    {"id": "early-eos-held", "input_ids": [3], "sampling_params": {"max_new_tokens": 12, "min_new_tokens": 6,
                                                                     "seed": 1}},
]


def make_run(conn: redis.Redis, model_dir: Path, out: Path, run: str, requests: list[dict] = REQUESTS) -> str:
    batch = pipeline.Client(conn).submit(requests, run=run, output=f"file://{out}", batch_size=3)
    RolloutWorker(conn, HFEngine(model_dir)).work(burst=True, with_scheduler=False, logging_level="WARNING")
    assert batch.wait(timeout=30).counts["finished"] == len(batch.job_ids)
    return f"{out}/{run}"


def test_same_weights_agree_and_other_weights_do_not(dense_run: str, tiny_model_dir: Path,
                                                       v1_model_dir: Path) -> None:
    rows = pipeline.read_rollouts(dense_run)
    tokens = sum(len(t) for t in rows.column("completion_token_ids").to_pylist())
    same = pipeline.verify(dense_run, str(tiny_model_dir))
    (summary,) = same.table.to_pylist()
    assert (summary["weight_version"], summary["engine"], summary["rows"]) == (0, "hf", rows.num_rows)
    assert summary["tokens"] == tokens and summary["nonfinite_tokens"] == 0
    assert summary["max_abs_diff"] <= SAME_WEIGHTS
    assert abs(summary["k3"]) < 1e-6 and abs(summary["ratio_mean"] - 1) < 1e-3
    assert summary["share_above"] == 0
    assert same.worst.num_rows > 0 and same.worst.column("abs_diff").to_pylist()[0] == summary["max_abs_diff"]

    other = pipeline.verify(dense_run, str(v1_model_dir))
    (summary,) = other.table.to_pylist()
    assert summary["tokens"] == tokens
    assert summary["max_abs_diff"] > 0.5 and summary["k3"] > 0.01 and summary["share_above"] > 0.1
    assert other.max_abs_diff > 0.5


def test_the_recomputation_reproduces_each_stored_token(dense_run: str, tiny_model_dir: Path) -> None:
    """The worst token named by the report carries the stored value of that row and position."""
    report = pipeline.verify(dense_run, str(tiny_model_dir), worst=3)
    rows = {r["rollout_id"]: r for r in pipeline.read_rollouts(dense_run).to_pylist()}
    for worst in report.worst.to_pylist():
        stored = rows[worst["rollout_id"]]["completion_logprobs"][worst["position"]]
        assert worst["stored_logprob"] == pytest.approx(stored, abs=1e-6)
        assert abs(worst["recomputed_logprob"] - stored) == pytest.approx(worst["abs_diff"], abs=1e-9)


def test_penalties_are_part_of_the_contract(dense_run: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The penalised row agrees only because verify applies its stored penalties: with them erased
    from the shard, the recomputation disagrees."""
    table = pipeline.read_rollouts(dense_run, filter=pipeline.request_id_in(["penalised"]))
    assert pipeline.verify(dense_run, str(tiny_model_dir)).max_abs_diff <= SAME_WEIGHTS
    erased = table
    for name, value in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        index = erased.schema.get_field_index(name)
        erased = erased.set_column(index, erased.schema.field(index), pa.array([value] * erased.num_rows,
                                                                                pa.float32()))
    pq.write_table(erased, tmp_path / "erased.parquet")
    assert pipeline.verify(str(tmp_path / "erased.parquet"), str(tiny_model_dir)).max_abs_diff > 0.05


def test_a_sample_of_rows(dense_run: str, tiny_model_dir: Path) -> None:
    first = pipeline.verify(dense_run, str(tiny_model_dir), rows=2, seed=1)
    again = pipeline.verify(dense_run, str(tiny_model_dir), rows=2, seed=1)
    assert first.table.column("rows").to_pylist() == [2]
    assert first.table.to_pylist() == again.table.to_pylist()


def test_cli_gates_on_max_abs_diff(dense_run: str, tiny_model_dir: Path, v1_model_dir: Path,
                                   pipeline_env: dict[str, str]) -> None:
    ok = subprocess.run([*PIPELINE, "verify", dense_run, "--model", str(tiny_model_dir), "--max-abs-diff", "1e-3",
                         "--json"], env=pipeline_env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["summary"][0]["tokens"] > 0 and report["max_abs_diff"] <= 1e-3
    bad = subprocess.run([*PIPELINE, "verify", dense_run, "--model", str(v1_model_dir), "--max-abs-diff", "1e-3",
                          "--max-share", "1"], env=pipeline_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "exceeds --max-abs-diff 0.001" in bad.stderr and "worst tokens" in bad.stdout


def test_cli_fails_by_default_against_other_weights(dense_run: str, v1_model_dir: Path,
                                                    pipeline_env: dict[str, str]) -> None:
    """A check with no gate given still fails loudly when many tokens disagree (issue 45: 39.8 % of the
    tokens off by more than 0.1 exited 0); `--max-share 1` turns the gate off."""
    wrong = subprocess.run([*PIPELINE, "verify", dense_run, "--model", str(v1_model_dir), "--json"],
                           env=pipeline_env, capture_output=True, text=True, timeout=120)
    report = json.loads(wrong.stdout)
    assert wrong.returncode == 1 and "are these the weights that generated them?" in wrong.stderr
    share = sum(r["share_above"] * r["tokens"] for r in report["summary"]) / report["tokens"]
    assert share > 0.05 and f"{share:.1%} of the tokens differ by more than 0.1" in wrong.stderr
    off = subprocess.run([*PIPELINE, "verify", dense_run, "--model", str(v1_model_dir), "--max-share", "1"],
                         env=pipeline_env, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr


def test_cli_reads_a_run_by_name_through_the_commit_log(dense_run: str, tiny_model_dir: Path,
                                                         pipeline_env: dict[str, str]) -> None:
    done = subprocess.run([*PIPELINE, "verify", "dense", "--model", str(tiny_model_dir), "--json"],
                          env=pipeline_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"][0]["rows"] == pipeline.read_rollouts(dense_run).num_rows


def make_swap_run(conn: redis.Redis, out: Path, v0: Path, v1: Path) -> str:
    """Two samples of 60 tokens on v0, partially swapped to v1 after 19 tokens: rows of both versions."""
    requests = [{"id": "long", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60, "n": 2, "seed": 3,
                                                                            "ignore_eos": True}}]
    batch = pipeline.Client(conn).submit(requests, run="swap", output=f"file://{out}")
    engine = CountingHF(v0)
    run_with_push(conn, engine, "partial", ready=lambda: engine.forwards >= 20, path=str(v1))
    assert batch.wait(timeout=30).counts["finished"] == 1
    return f"{out}/swap"


def test_partial_swap_rows_are_checked_per_token_version(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, v1_model_dir: Path
) -> None:
    url = make_swap_run(redis_client, tmp_path, tiny_model_dir, v1_model_dir)
    rows = pipeline.read_rollouts(url).to_pylist()
    boundaries = [r["weight_version_segments"][1]["start"] for r in rows]
    both = pipeline.verify(url, {0: str(tiny_model_dir), 1: str(v1_model_dir)})
    by_version = {r["weight_version"]: r for r in both.table.to_pylist()}
    assert by_version[0]["tokens"] == sum(boundaries) and by_version[1]["tokens"] == 120 - sum(boundaries)
    assert both.max_abs_diff <= SAME_WEIGHTS

    only_v0 = pipeline.verify(url, [f"0={tiny_model_dir}"])
    by_version = {r["weight_version"]: r for r in only_v0.table.to_pylist()}
    assert by_version[0]["tokens"] == sum(boundaries) and by_version[0]["max_abs_diff"] <= SAME_WEIGHTS
    assert by_version[1]["tokens"] == 0 and by_version[1]["unchecked_tokens"] == 120 - sum(boundaries)

    one_model = pipeline.verify(url, str(tiny_model_dir))  # v1's tokens against v0: a clear mismatch
    by_version = {r["weight_version"]: r for r in one_model.table.to_pylist()}
    assert by_version[0]["max_abs_diff"] <= SAME_WEIGHTS and by_version[1]["max_abs_diff"] > 0.5


def test_moe_routed_experts_match_the_recomputed_router(
    redis_client: redis.Redis, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    requests = [{"id": f"q{i}", "input_ids": [token_id(c) for c in prompt], "return_routed_experts": True,
                 "sampling_params": {"max_new_tokens": 10, "n": 2, "seed": i}}
                for i, prompt in enumerate(["hello", "ab"])]
    url = make_run(redis_client, tiny_moe_dir, tmp_path / "out", "moe", requests)
    report = pipeline.verify(url, str(tiny_moe_dir))
    assert report.max_abs_diff <= SAME_WEIGHTS
    experts = report.experts.to_pylist()
    rows = pipeline.read_rollouts(url).to_pylist()
    positions = sum(r["prompt_tokens"] + r["completion_tokens"] - 1 for r in rows)
    assert [e["layer"] for e in experts] == [0, 1]
    assert all(e["positions"] == positions and e["share"] == 1.0 for e in experts)

    wrong = pipeline.verify(url, str(build_random_moe_model(tmp_path / "other-moe", seed=1)))
    assert wrong.max_abs_diff > 0.5
    assert all(e["share"] < 0.9 for e in wrong.experts.to_pylist())


def _hostile(dense_run: str, tmp_path: Path, change) -> str:  # type: ignore[no-untyped-def]
    table = pipeline.read_rollouts(dense_run)
    path = tmp_path / "hostile.parquet"
    pq.write_table(change(table), path)
    return str(path)


def _replace(table: pa.Table, name: str, values: list) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: _replace(t, "completion_logprobs", [lp[:-1] for lp in t.column("completion_logprobs").to_pylist()]),
     r"row '.+': \d+ completion logprobs for \d+ completion tokens"),
    (lambda t: _replace(t, "completion_token_ids", [[*ids[:-1], 500] for ids in
                                                     t.column("completion_token_ids").to_pylist()]),
     r"completion_token_ids holds id 500, outside the model's vocabulary \(0\.\.71\)"),
    (lambda t: t.drop_columns(["completion_logprobs"]), r"lack columns \['completion_logprobs'\]"),
    (lambda t: _replace(t, "resumed_at", [[len(ids)] for ids in t.column("completion_token_ids").to_pylist()]),
     r"resumed_at \[\d+\] are not ascending offsets inside its \d+ completion tokens"),
])
def test_hostile_shards_are_refused(dense_run: str, tiny_model_dir: Path, tmp_path: Path, change, message: str
                                    ) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pipeline.PipelineError, match=message):
        pipeline.verify(_hostile(dense_run, tmp_path, change), str(tiny_model_dir))


def test_no_shards_and_bad_model_arguments_are_clear(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(pipeline.NoShardsError):
        pipeline.verify(str(tmp_path), str(tiny_model_dir))
    with pytest.raises(pipeline.PipelineError, match="cannot be mixed"):
        parse_models([str(tiny_model_dir), f"1={tiny_model_dir}"])
    assert parse_models(["0=/a", "3=/b=c"]) == {0: "/a", 3: "/b=c"}
    assert parse_models("/m") == {None: "/m"}
    np.testing.assert_equal(parse_models({2: Path("/x")}), {2: "/x"})


def test_demo_model_same_weights_agree_and_its_v1_does_not(
    redis_client: redis.Redis, demo_model_dir: Path, tmp_path: Path
) -> None:
    """The issue's figure on the demo model (SmolLM2-135M): rows of v0 checked against v0 within
    1e-3 with k3 ~ 0; rows of the demo's perturbed v1 against v0 clearly off."""
    from workers.engines.hf.demo_model import ensure_perturbed_copy

    requests = [{"id": f"d{i}", "input_ids": [1, 504, 3458, 314, 260 + i], "sampling_params": {
        "max_new_tokens": 12, "temperature": [1.0, 0.0][i % 2], "seed": i, "ignore_eos": True}} for i in range(2)]
    v0 = make_run(redis_client, demo_model_dir, tmp_path, "demo-v0", requests)
    v1 = make_run(redis_client, ensure_perturbed_copy(demo_model_dir), tmp_path, "demo-v1", requests)
    same = pipeline.verify(v0, str(demo_model_dir))
    assert same.max_abs_diff <= SAME_WEIGHTS and abs(same.table.column("k3")[0].as_py()) < 1e-6
    assert pipeline.verify(v1, str(demo_model_dir)).max_abs_diff > 0.1

"""The command line a newcomer leans on (issue 36, friction): `pipeline runs` and `runs delete`,
`pools delete`, run names wherever a URL is taken (`show`), `cancel NAME` pointing at `--run`,
pushes to a pool nobody serves or from a path that does not exist, and `demo` as a model name."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.cli.main import main
from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.command import EXIT_FAILED, EXIT_TIMEOUT, EXIT_USAGE
from schemas.worker_info import WorkerInfo
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker

REQUESTS = [{"id": f"r{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "n": 2}}
            for i in range(3)]


def _cli(capsys: pytest.CaptureFixture[str], redis_url: str, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--redis", redis_url])
    out, err = capsys.readouterr()
    return code, out, err


def _serve(conn: redis.Redis, pool: str | None = None) -> None:
    """A burst worker in this process: every queued job of the pool runs, then it returns."""
    RolloutWorker(conn, FakeEngine(), pool=pool).work(burst=True, with_scheduler=False, logging_level="WARNING")


def test_runs_lists_every_run_newest_first_with_jobs_and_rows_and_delete_forgets_one(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    client.submit(REQUESTS, run="older", output=output, batch_size=2)
    _serve(redis_client)
    time.sleep(0.002)  # the newest-first order is by submit time (milliseconds)
    client.submit(REQUESTS[:1], run="newer", output=output)

    code, out, _ = _cli(capsys, redis_url, "runs")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["run", "pool", "submitted", "jobs", "rows", "tokens"]
    assert [line.split()[0] for line in lines[1:]] == ["newer", "older"]
    newer, older = (line.split() for line in lines[1:])
    assert newer[1] == "default" and newer[4:7] == ["0/1", "0", "0"]  # queued, nothing committed
    assert older[4:6] == ["2/2", "6"] and older[-1] == f"{output}/older"

    # A run with a job still queued is not deleted (nothing is), and says what to do.
    code, _, err = _cli(capsys, redis_url, "runs", "delete", "newer")
    assert code == EXIT_USAGE and "pipeline cancel --run newer" in err and "nothing was deleted" in err
    assert "newer" in registry.runs(redis_client)
    # A name that is no run: "did you mean".
    code, _, err = _cli(capsys, redis_url, "runs", "delete", "oldre")
    assert code == EXIT_FAILED and "did you mean 'older'?" in err

    assert (tmp_path / "older").is_dir()
    code, out, _ = _cli(capsys, redis_url, "runs", "delete", "older", "--shards")
    assert code == 0 and out.startswith("deleted run older: 2 job(s), 6 row(s) committed; shards removed from")
    assert not (tmp_path / "older").exists()
    assert registry.runs(redis_client) == ["newer"]
    assert not list(redis_client.scan_iter(match="pipeline:*older*"))
    code, out, _ = _cli(capsys, redis_url, "runs", "--json")
    assert [run["run"] for run in json.loads(out)] == ["newer"]


def test_pools_delete_refuses_a_live_pool_and_forgets_an_idle_one_with_its_weights_and_runs(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = pipeline.Client(redis_client, pool="scratch")
    client.submit(REQUESTS[:1], run="in-scratch", output=f"file://{tmp_path}")
    _serve(redis_client, "scratch")
    control_channel.push_weights(redis_client, str(tmp_path), 3, pool="scratch", timeout=0)
    now = time.time()
    registry.publish(redis_client, WorkerInfo(worker_id="w1", pool="scratch", host="h", pid=1, engine="fake",
                                              model="m", started_at=now, heartbeat_at=now))

    code, out, _ = _cli(capsys, redis_url, "pools")
    assert out.splitlines() == ["default: 0 live worker(s), weights v0",
                                f"scratch: 1 live worker(s), weights v3 from {tmp_path}"]
    code, _, err = _cli(capsys, redis_url, "pools", "delete", "scratch")
    assert code == EXIT_USAGE and "1 live worker(s) (w1)" in err and "nothing was deleted" in err
    assert control_channel.read_state(redis_client, "scratch").weight_version == 3
    code, _, err = _cli(capsys, redis_url, "pools", "delete", "scrach")
    assert code == EXIT_USAGE and "did you mean 'scratch'?" in err

    registry.remove(redis_client, "w1", "scratch")
    code, out, _ = _cli(capsys, redis_url, "pools", "delete", "scratch")
    assert code == 0, out
    assert out.strip() == f"deleted pool scratch: desired weights v3 from {tmp_path}, 1 run(s) (shards kept)"
    assert registry.pools(redis_client) == [keys.DEFAULT_POOL] and registry.runs(redis_client) == []
    assert control_channel.read_state(redis_client, "scratch").weight_version == 0
    assert not list(redis_client.scan_iter(match="pipeline:pool:scratch:*"))
    assert not redis_client.exists("rq:queue:rollouts.scratch")


def test_show_takes_a_run_name_with_did_you_mean_and_cancel_of_a_run_name_points_at_run(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = pipeline.Client(redis_client)
    client.submit(REQUESTS[:1], run="tour-0", output=f"file://{tmp_path}")
    _serve(redis_client)

    code, out, _ = _cli(capsys, redis_url, "show", "tour-0", "--json")
    assert code == 0 and [json.loads(line)["request_id"] for line in out.splitlines()] == ["r0", "r0"]
    code, _, err = _cli(capsys, redis_url, "show", "tuor-0")
    assert code == EXIT_FAILED and "did you mean 'tour-0'?" in err

    client.submit(REQUESTS[:1], run="cxl", output=f"file://{tmp_path}")
    code, _, err = _cli(capsys, redis_url, "cancel", "cxl")
    assert code == EXIT_USAGE and "'cxl' is a run, not a job id: `pipeline cancel --run cxl`" in err
    assert redis_client.scard(keys.canceled("cxl")) == 0
    code, _, err = _cli(capsys, redis_url, "cancel", "--run", "cxll")
    assert code == EXIT_FAILED and "no run 'cxll' in this Redis" in err and "did you mean 'cxl'?" in err


def test_a_push_to_a_pool_nobody_named_warns_and_a_missing_path_is_refused_as_missing(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipeline.Client(redis_client, pool="tour").submit(REQUESTS[:1], run="t", output=f"file://{tmp_path}")
    code, _, err = _cli(capsys, redis_url, "weights", "push", str(tmp_path), "--version", "1", "--pool", "tuor")
    assert code == EXIT_USAGE and "did you mean 'tour'?" in err and "--new-pool" in err  # a typo: nothing pushed
    assert control_channel.read_state(redis_client, "tuor").weight_version == 0
    code, out, err = _cli(capsys, redis_url, "weights", "push", str(tmp_path), "--version", "1", "--pool", "tuor",
                          "--new-pool")
    assert code == 0 and "pool tuor: weights v1" in out, err
    assert "warning: no worker has ever served pool 'tuor' and nothing was submitted to it" in err

    # A sim worker takes any path (so do HTTP engines' servers, wherever they run): a warning only.
    now = time.time()
    missing = tmp_path / "no-such-checkpoint"
    registry.publish(redis_client, WorkerInfo(worker_id="w0", pool="sim", host=socket.gethostname(), pid=1,
                                              engine="sim", model="m", started_at=now, heartbeat_at=now))
    code, _, err = _cli(capsys, redis_url, "weights", "push", str(missing), "--version", "1", "--pool", "sim",
                        "--timeout", "0.5")
    assert f"warning: weight path {missing} does not exist on this machine" in err
    assert code == EXIT_TIMEOUT and "no worker loaded it" in err  # pushed, and waited for (this entry never answers)
    # Every live worker of the pool loads weights from this machine's disk, where the path does not exist.
    registry.publish(redis_client, WorkerInfo(worker_id="w1", pool="tour", host=socket.gethostname(), pid=1,
                                              engine="hf", model="m", started_at=now, heartbeat_at=now))
    code, _, err = _cli(capsys, redis_url, "weights", "push", str(missing), "--version", "1", "--pool", "tour")
    assert code == EXIT_USAGE and f"weight path {missing} does not exist" in err and "nothing was pushed" in err
    assert control_channel.read_state(redis_client, "tour").weight_version == 0
    # A store push reads the checkpoint here, whoever serves the pool: missing is an error, not a warning.
    code, _, err = _cli(capsys, redis_url, "weights", "push", str(missing), "--version", "1", "--pool", "sim",
                        "--delta", "--store", f"file://{tmp_path}/store")
    assert code == EXIT_USAGE and f"weight path {missing} does not exist: a store push" in err
    assert "Nothing was pushed" in err and not (tmp_path / "store").exists()
    assert control_channel.read_state(redis_client, "sim").weight_version == 0  # the timed-out push rolled back


def test_demo_names_the_demo_models_directory_or_says_how_to_make_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str, redis_client: redis.Redis,
        demo_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.core.demo_model import resolve, resolve_versioned
    from pipeline.core.errors import PipelineError
    from workers.engines.hf.demo_model import ensure_perturbed_copy

    ensure_perturbed_copy(demo_model_dir)  # what `pipeline demo` leaves on disk beside the model
    assert resolve("demo") == str(demo_model_dir)
    assert resolve("demo-perturbed") == f"{demo_model_dir}-perturbed"
    assert resolve_versioned("1=demo") == f"1={demo_model_dir}"
    assert resolve("some/dir") == "some/dir"
    # A chat line rendered with `--tokenizer demo`: the demo model's chat template.
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"id": "c", "messages": [{"role": "user", "content": "Hi"}]}\n')
    code, out, err = _cli(capsys, redis_url, "submit", str(chat), "--tokenizer", "demo", "--run", "chat",
                          "--output", f"file://{tmp_path}")
    assert code == 0 and "requests: 1" in out, err

    monkeypatch.setenv("PIPELINE_MODEL_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(PipelineError, match="not there yet: run `pipeline demo`"):
        resolve("demo")


def test_runs_counts_agent_turns_and_episodes_as_what_they_are() -> None:
    """A run of agent turns has no submitted batch job: it reads "11 agent turns", not "11/0" jobs."""
    from pipeline.audit.runs import RunSummary, format_runs

    agents = RunSummary(run="agents", pools=["default"], submitted_at=None, jobs=0, committed_jobs=11, rows=11,
                        tokens=40, outputs=[], turns=11)
    episodic = RunSummary(run="step-0", pools=["default"], submitted_at=None, jobs=0, committed_jobs=16, rows=16,
                          tokens=90, outputs=[], turns=16, episodes=(7, 8))
    mixed = RunSummary(run="both", pools=["default"], submitted_at=None, jobs=2, committed_jobs=5, rows=9,
                       tokens=50, outputs=[], turns=3)
    text = format_runs([agents, episodic, mixed])
    assert "11 agent turns" in text and "11/0" not in text
    assert "7/8 episodes, 16 agent turns" in text
    assert "2/2, 3 agent turns" in text


def test_a_mistyped_demo_model_name_is_refused_with_the_name_it_meant(
        redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, redis_url, "weights", "push", "demo-perturbd", "--version", "1")
    assert code == EXIT_USAGE and "did you mean 'demo-perturbed'?" in err and "nothing was pushed" in err


def test_runs_counts_an_agent_runs_shards_as_status_does_and_says_where_they_are(
        redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    """A run of agent turns (`pipeline serve`) has no batch output: its shards and where they are come
    from its committed turn shards and the output its sessions write to."""
    from pipeline.audit.status import collect
    from pipeline.core.broker import commit_log
    from pipeline.serve.sessions import SessionStore

    SessionStore(redis_client).create(run="ep-0", pool="default", output="file:///data/out")
    for index in range(7):
        commit_log.append(redis_client, "ep-0", commit_log.Commit(
            job_id=f"turns-{index}", batch_id="turns", url=f"file:///data/out/ep-0/turns-{index}.parquet", rows=2,
            tokens=10, weight_version=0))
    assert collect(redis_client, pool="default")["pools"]["default"]["runs"]["ep-0"]["shards"] == 7
    code, out, _ = _cli(capsys, redis_url, "runs")
    header, line = out.splitlines()
    assert code == 0 and header.split()[6:] == ["shards", "where"]
    assert line.split()[-2:] == ["7", "file:///data/out/ep-0"]
    code, out, _ = _cli(capsys, redis_url, "runs", "--json")
    assert json.loads(out)[0]["shards"] == 7 and json.loads(out)[0]["outputs"] == ["file:///data/out/ep-0"]

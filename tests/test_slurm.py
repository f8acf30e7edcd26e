"""deploy/slurm/pipeline.sbatch on a real single-node Slurm the test starts (tests/helpers/slurm_cluster.py),
with the sim engine on two stand-in GPUs: a trainer's submit runs through the allocation's Redis,
sentinels and workers; `scancel`, or the trainer exiting, leaves no process of the job behind; an
allocation with fewer GPUs than asked is refused, saying what to do. Skipped, saying why, where
Slurm cannot run (not root, or no slurm-wlm/munge: `.ci/run` installs them)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipeline
from tests.helpers import slurm_cluster
from tests.helpers.processes import free_ports, wait_until
from tests.helpers.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "deploy" / "slurm" / "pipeline.sbatch"
REQUESTS = 40

pytestmark = pytest.mark.skipif(slurm_cluster.unavailable() is not None,
                                reason=slurm_cluster.unavailable() or "")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def _submit(slurm: SlurmCluster, tmp_path: Path, trainer: str, *, gpus_per_node: int = 2) -> tuple[str, Path]:
    """sbatch the launcher with a trainer script; the job id and its output file."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": [5, 6, 7],
                                            "sampling_params": {"max_new_tokens": 16}}) + "\n"
                                for i in range(REQUESTS)))
    script = tmp_path / "trainer.sh"
    script.write_text(f"#!/bin/bash\nset -e\n{trainer.format(requests=requests, marker=tmp_path / 'submitted')}\n")
    script.chmod(0o755)
    output = tmp_path / "job.out"
    env = {**slurm.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "GPUS_PER_NODE": str(gpus_per_node), "WORKER_ARGS": "--engine sim --sim-step-ms 5",
           "REDIS_PORT": str(free_ports(2)), "SENTINEL_PORT": str(free_ports(3)), "STATE_DIR": str(tmp_path / "state"),
           "STOP_GRACE": "10"}
    env["PIPELINE_CONTROL_SECRET"] = "slurm-test-key"
    env.pop("PIPELINE_REDIS_URL", None)
    job = slurm_cluster.run_with(env, "sbatch", "--parsable", "--gres", f"gpu:{slurm_cluster.GPUS}", "-o", str(output),
                                 "-D", str(tmp_path), str(LAUNCHER), str(script)).strip()
    return job, output


def _left_behind(job: str, workdir: Path) -> list[str]:
    """The command lines of processes still carrying this job's id, or working in the job's directory
    (`pipeline worker` sets its title over its environment, so its job id no longer shows there)."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (f"SLURM_JOB_ID={job}".encode() in (proc / "environ").read_bytes().split(b"\0")
                    or Path(os.readlink(proc / "cwd")) == workdir):
                left.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return left


def _rows(tmp_path: Path) -> list[str]:
    table = pipeline.read_rollouts(str(tmp_path / "state" / "shards"), "slurmrun")
    return sorted(table.column("request_id").to_pylist())


@pytest.mark.parametrize("scancel", [["scancel"], ["scancel", "--batch", "--signal", "TERM"]],
                         ids=["cancel", "signal-the-launcher"])
def test_a_submit_runs_through_the_allocation_and_scancel_leaves_no_process(slurm: SlurmCluster, tmp_path: Path,
                                                                            scancel: list[str]) -> None:
    """Cancelled, Slurm signals every process of the job; the launcher alone signalled stops them in order."""
    job, output = _submit(slurm, tmp_path, "pipeline submit {requests} --run slurmrun --wait --timeout 120\n"
                                           "touch {marker}\nexec sleep infinity")
    try:
        wait_until(lambda: (tmp_path / "submitted").exists() or slurm.job_gone(job), 240, "the trainer's submit")
        assert (tmp_path / "submitted").exists(), output.read_text()
        assert _rows(tmp_path) == sorted(f"q{i}" for i in range(REQUESTS))
        assert _left_behind(job, tmp_path), "the check for leftovers sees nothing of a running job"
        assert any(line.startswith("pipeline worker (") for line in _left_behind(job, tmp_path)), \
            "the check for leftovers sees no worker of a running job"
    finally:
        slurm.run(*scancel, job)
    wait_until(lambda: slurm.job_gone(job) and not _left_behind(job, tmp_path), 120,
               "the cancelled job's processes to end")
    if "--batch" in scancel:
        log = output.read_text()
        assert "stopping: workers, then serve" in log and "stopped (logs and Redis's data in" in log, log


def test_the_trainer_exiting_stops_everything(slurm: SlurmCluster, tmp_path: Path) -> None:
    job, output = _submit(slurm, tmp_path, "pipeline submit {requests} --run slurmrun --wait --timeout 120")
    wait_until(lambda: slurm.job_gone(job), 240, "the job to end with its trainer")
    log = output.read_text()
    assert "trainer exited with status 0" in log and "stopped (logs and Redis's data in" in log, log
    assert _rows(tmp_path) == sorted(f"q{i}" for i in range(REQUESTS))
    # A worker still shutting down when Slurm ends the step (srun ends a step it is signalled to stop)
    # gets SIGTERM when its node's shell dies, and ends within seconds; none runs on.
    wait_until(lambda: not _left_behind(job, tmp_path), 60, "the job's workers to end")
    assert "ExitCode=0:0" in slurm.run("scontrol", "show", "job", job)


def test_an_allocation_with_fewer_gpus_than_asked_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    job, output = _submit(slurm, tmp_path, "pipeline submit {requests} --run slurmrun --wait",
                          gpus_per_node=slurm_cluster.GPUS + 2)
    wait_until(lambda: slurm.job_gone(job), 120, "the refused job to end")
    log = output.read_text()
    assert (f"has {slurm_cluster.GPUS} GPU(s) in job {job} and GPUS_PER_NODE asks for {slurm_cluster.GPUS + 2}"
            in log), log
    assert f"--gres gpu:{slurm_cluster.GPUS + 2}" in log and "nothing was started" in log
    assert not (tmp_path / "state").exists() and _left_behind(job, tmp_path) == []

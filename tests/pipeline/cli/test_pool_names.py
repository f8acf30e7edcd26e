"""A mistyped pool is caught like a mistyped command (real redis-server, the `pipeline` CLI): a submit
into a never-named pool whose name is close to a known one is refused with "did you mean", nothing
enqueued; `--new-pool` says it is meant; `status --pool` of an unknown pool is an error."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import redis

from pipeline.core.broker import keys, registry
from pipeline.core.command import EXIT_USAGE
from tests.conftest import PIPELINE


def test_a_typo_in_a_pool_name_is_refused_with_the_closest_pool(pipeline_env: dict[str, str],
                                                                redis_client: redis.Redis, tmp_path: Path) -> None:
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) + "\n")

    def pipeline(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*PIPELINE, *args], env=pipeline_env, capture_output=True, text=True, timeout=120)

    first = pipeline("submit", str(requests), "--pool", "tour", "--run", "r1")  # a new name, close to none
    assert first.returncode == 0, first.stderr
    assert "pool 'tour' is new: no worker serves it yet (`pipeline worker --pool tour`)" in first.stderr

    typo = pipeline("submit", str(requests), "--pool", "tuor", "--run", "r2")
    assert typo.returncode == EXIT_USAGE
    assert "pool 'tuor' has never been named on this Redis" in typo.stderr and "did you mean 'tour'?" in typo.stderr
    assert "--new-pool" in typo.stderr
    assert redis_client.llen(f"rq:queue:{keys.pool('tour').queue_name}") == 1  # the first submit's job
    assert redis_client.llen(f"rq:queue:{keys.pool('tuor').queue_name}") == 0
    assert "tuor" not in registry.pools(redis_client)

    meant = pipeline("submit", str(requests), "--pool", "tuor", "--run", "r2", "--new-pool")
    assert meant.returncode == 0, meant.stderr
    assert pipeline("submit", str(requests), "--pool", "tuor", "--run", "r3").returncode == 0  # known now

    status = pipeline("status", "--pool", "nosuchpool")
    assert status.returncode == EXIT_USAGE and "pool 'nosuchpool' has never been named" in status.stderr
    assert pipeline("status", "--pool", "tour").returncode == 0


# Every command that takes --pool, with the arguments it needs to get past argparse (the guard
# runs before the command does anything: no engine, server or agent is started for a typo).
NAMING = {
    "worker": ["worker", "--engine", "sim", "--burst"],
    "serve": ["serve", "--port", "0"],
    "agent-worker": ["agent-worker", "--agent", "examples.calculator_agent:solve", "--burst"],
    "reward-worker": ["reward-worker", "--burst"],
    "weights push": ["weights", "push", "demo-perturbed", "--version", "1", "--timeout", "1"],
    "pause": ["pause"],
    "resume": ["resume"],
}
READING = {
    "status": ["status"],
    "runs": ["runs"],
    "cancel": ["cancel", "--run", "r1"],
    "weights status": ["weights", "status"],
}


def test_every_command_that_takes_a_pool_refuses_a_typo_of_a_live_one(
        pipeline_env: dict[str, str], redis_client: redis.Redis, tmp_path: Path) -> None:
    """`worker`, `serve`, `agent-worker` ... `--pool epp` beside a live pool `ep`: refused with "did you
    mean", the typo never registered (so it cannot pass a later guard); `--new-pool` means it."""
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) + "\n")

    def pipeline(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*PIPELINE, *args], env={**pipeline_env, **env}, capture_output=True, text=True,
                              timeout=120)

    assert pipeline("submit", str(requests), "--pool", "ep", "--run", "r1").returncode == 0
    for name, argv in NAMING.items():
        typo = pipeline(*argv, "--pool", "epp")
        assert typo.returncode == EXIT_USAGE, (name, typo.stderr)
        assert "did you mean 'ep'?" in typo.stderr and "--new-pool" in typo.stderr, (name, typo.stderr)
    for name, argv in READING.items():
        typo = pipeline(*argv, "--pool", "epp")
        assert typo.returncode == EXIT_USAGE, (name, typo.stderr)
        assert "pool 'epp' has never been named" in typo.stderr and "did you mean 'ep'?" in typo.stderr, name
    from_env = pipeline(*NAMING["worker"], PIPELINE_POOL="epp")
    assert from_env.returncode == EXIT_USAGE and "did you mean 'ep'?" in from_env.stderr
    assert "epp" not in registry.pools(redis_client)

    meant = pipeline(*NAMING["worker"], "--pool", "epp", "--new-pool")
    assert meant.returncode == 0, meant.stderr
    assert "note: pool 'epp' is new on this Redis" in meant.stderr
    assert "epp" in registry.pools(redis_client)
    assert pipeline("status", "--pool", "epp").returncode == 0

"""`pipeline agent-worker --concurrency C` caps the episodes the worker runs at once, however many
agents it runs: a real agent-worker process with two agents, each with a backlog, against a real
Redis, `pipeline serve` and a rollout worker answering their turns. The agents
(`tests.helpers.gated_agents`) count themselves in Redis and wait to be let go; the test lets one go
each time a new one started, so every episode runs, and the most ever counted at once is C."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

import pipeline
from pipeline.serve.server import Server
from tests.conftest import PIPELINE
from tests.helpers import gated_agents
from tests.helpers.processes import drive_worker, terminate, wait_until
from workers.engines.fake import FakeEngine

AGENTS = ("tests.helpers.gated_agents:gated", "tests.helpers.gated_agents:gated_too")
CAP = 3
PER_AGENT = 4


def test_concurrency_caps_the_episodes_of_all_agents_together(
        redis_client: redis.Redis, server: Server, pipeline_env: dict[str, str], tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    runs = [client.submit_episodes([{"id": f"t{i}"} for i in range(PER_AGENT)], agent=name, run=f"cap-{k}")
            for k, name in enumerate(AGENTS)]
    total = PER_AGENT * len(AGENTS)
    log = tmp_path / "agent-worker.log"

    def trainer() -> None:
        with log.open("w") as out:
            process = subprocess.Popen([*PIPELINE, "agent-worker", "--agent", AGENTS[0], "--agent", AGENTS[1],
                                        "--concurrency", str(CAP), "--serve", server.url, "--burst"],
                                       env=pipeline_env, stdout=out, stderr=subprocess.STDOUT)
        try:
            def started() -> int:
                assert process.poll() is None, log.read_text()
                return int(redis_client.llen(gated_agents.PEAKS))

            for released in range(total):
                wait_until(lambda r=released: started() >= min(total, CAP + r), 60,
                           f"{min(total, CAP + released)} episodes started")
                redis_client.rpush(gated_agents.RELEASE, 1)
            for run in runs:
                counts = run.wait(timeout=60)
                assert counts["finished"] == PER_AGENT, (counts, log.read_text()[-3000:])
            assert process.wait(timeout=60) == 0, log.read_text()
        finally:
            terminate(process)

    drive_worker(redis_client, FakeEngine(), trainer, stop_when_done=True)  # the rollout worker: the turns
    peaks = [int(p) for p in redis_client.lrange(gated_agents.PEAKS, 0, -1)]
    assert len(peaks) == total
    assert max(peaks) == CAP, f"episodes at once: {peaks} (--concurrency {CAP})"

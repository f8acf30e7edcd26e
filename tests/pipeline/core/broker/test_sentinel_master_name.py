"""A Sentinel URL whose master name no sentinel watches is a clear error at once (the sentinels answered;
the name is wrong), never a minute of retries ending in a wall of connection reprs; a name they watch
whose master is down is still waited out as an outage."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pipeline.core.broker.connection import connect_redis
from pipeline.core.errors import RedisURLError
from tests.conftest import PIPELINE
from tests.helpers.sentinel_group import SentinelGroup

ROOT = Path(__file__).resolve().parents[4]


def test_a_worker_pointed_at_a_master_name_no_sentinel_watches_says_so(tmp_path: Path) -> None:
    with SentinelGroup(tmp_path / "sentinel", replicas=0, sentinels=1) as group:
        wrong = group.url.replace("/pipeline/", "/pipelnie/")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_REDIS_RECONNECT_S": "600"}
        # Without the check this retries for the 600 s above: the timeout is a hang guard, not a measure.
        result = subprocess.run([*PIPELINE, "worker", "--engine", "sim", "--burst", "--redis", wrong],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: the sentinels at 127.0.0.1:") and "Traceback" not in result.stderr
        assert "watch no master named 'pipelnie' (they watch: 'pipeline')" in result.stderr
        with pytest.raises(RedisURLError, match="watch no master named 'pipelnie'"):
            connect_redis(wrong).ping()
        assert connect_redis(group.url).ping()

"""Hostile and bad input: signed control messages, weight/output restrictions, submit limits, Redis URLs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import control_channel, keys
from pipeline.core.broker.connection import client_kwargs, connect_redis, redacted
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.errors import PolicyError, RequestFileError
from pipeline.submit.request_file import parse_lines
from schemas import request as request_schema
from schemas.control import DesiredState, WeightAck, encode
from tests.helpers.processes import free_port
from workers.engines.fake import FakeEngine
from workers.process import control_follower as worker_control
from workers.process.worker import RolloutWorker

SECRET = "s3cret-for-tests"


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setenv("PIPELINE_CONTROL_SECRET", SECRET)
    return SECRET.encode()


def test_signed_state_is_obeyed_and_forged_or_unsigned_state_refused(
    redis_client: redis.Redis, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    state = control_channel.pause(redis_client)
    stored = json.loads(redis_client.get(keys.pool().control_state))
    assert set(stored) == {"body", "hmac"} and control_channel.read_state(redis_client) == state

    worker = RolloutWorker(redis_client, FakeEngine())
    assert worker.sync_control().paused
    # Someone who can reach Redis but lacks the secret: unsigned, then signed with a guess.
    redis_client.set(keys.pool().control_state, DesiredState(generation=9).model_dump_json())
    with pytest.raises(control_channel.ControlAuthError, match="unsigned record refused"):
        control_channel.read_state(redis_client)
    assert worker.sync_control().paused  # the worker keeps what it had
    forged = encode(DesiredState(generation=9, weight_path="/evil", weight_version=5), secret=b"guess",
                    purpose="desired-state")
    redis_client.set(keys.pool().control_state, forged)
    with pytest.raises(control_channel.ControlAuthError, match="signature does not match"):
        control_channel.read_state(redis_client)
    assert worker.sync_control().paused and worker.engine.updates == []
    assert "control state refused" in caplog.text
    # The trainer takes the key back with a signed change.
    assert control_channel.resume(redis_client).generation == 10
    assert not worker.sync_control().paused


def test_forged_and_replayed_acks_are_refused(redis_client: redis.Redis, secret: bytes) -> None:
    good = WeightAck(worker="w1", version=3, ok=True, seconds=0.1)
    worker_control.write_ack(redis_client, good)
    redis_client.hset(keys.pool().weight_acks(3), "w2", WeightAck(worker="w2", version=3, ok=True, seconds=0.1)
                      .model_dump_json())  # unsigned
    redis_client.hset(keys.pool().weight_acks(3), "w3", redis_client.hget(keys.pool().weight_acks(3), "w1"))  # replayed
    assert control_channel.read_acks(redis_client, 3) == {"w1": good}


def test_weight_paths_outside_the_allowed_prefixes_are_refused(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_ALLOWED_WEIGHT_PREFIXES", "/ckpt,s3://bucket/weights")
    with pytest.raises(PolicyError, match="outside the allowed prefixes"):
        control_channel.push_weights(redis_client, "/etc/passwd", 1, timeout=1)
    with pytest.raises(PolicyError):
        control_channel.push_weights(redis_client, "/ckpt/../etc", 1, timeout=1)
    with pytest.raises(PolicyError):
        control_channel.push_weights(redis_client, "/ckpt-evil/x", 1, timeout=1)
    # A worker refuses such a path even when a trainer without the policy pushed it.
    engine = FakeEngine()
    ack = worker_control.load_weights(engine, "w", "/tmp/evil", 1)
    assert not ack.ok and "refused" in (ack.error or "") and engine.updates == []
    assert worker_control.load_weights(engine, "w", "s3://bucket/weights/step-1", 1).ok


def test_output_urls_are_restricted_at_submit_and_in_the_worker(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    client = pipeline.Client(redis_client)
    request = {"id": "a", "input_ids": [1, 2]}
    monkeypatch.setenv("PIPELINE_ALLOWED_OUTPUT_SCHEMES", "s3")
    with pytest.raises(PolicyError, match="scheme 'file'"):
        client.submit([request], run="r", output=f"file://{tmp_path}")
    monkeypatch.delenv("PIPELINE_ALLOWED_OUTPUT_SCHEMES")
    batch = client.submit([request], run="r", output=f"file://{tmp_path}")  # allowed when submitted
    monkeypatch.setenv("PIPELINE_ALLOWED_OUTPUT_PREFIXES", "s3://bucket/rollouts")
    engine = FakeEngine()
    RolloutWorker(redis_client, engine).work(burst=True, with_scheduler=False, logging_level="CRITICAL")
    assert engine.calls == []  # refused before anything ran
    with pytest.raises(pipeline.JobsFailedError, match="outside the allowed prefixes"):
        batch.wait(timeout=5)
    assert Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer).count == 0


def _line(**overrides: object) -> str:
    return json.dumps({"id": "q", "input_ids": [1, 2, 3], **overrides})


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        (_line(input_ids=[1] * (request_schema.MAX_PROMPT_TOKENS + 1)), "input_ids", "PIPELINE_MAX_PROMPT_TOKENS"),
        (_line(sampling_params={"max_new_tokens": 10**7}), "sampling_params.max_new_tokens", "less than or equal"),
        (_line(sampling_params={"n": 5000}), "sampling_params.n", "less than or equal"),
        (_line(sampling_params={"stop": ["x"] * 65}), "sampling_params.stop", "PIPELINE_MAX_STOPS"),
        (_line(sampling_params={"stop_token_ids": list(range(65))}), "sampling_params.stop_token_ids", "65 stop"),
        (_line(sampling_params={"stop": "y" * 2000}), "sampling_params.stop", "PIPELINE_MAX_STOP_CHARS"),
        (_line(metadata={"blob": "z" * 70_000}), "metadata", "PIPELINE_MAX_METADATA_BYTES"),
    ],
)
def test_submit_limits_give_located_errors(line: str, field: str, message: str) -> None:
    with pytest.raises(RequestFileError) as caught:
        parse_lines(["", line], path="big.jsonl")
    [error] = caught.value.errors
    assert (error.path, error.line, error.field) == ("big.jsonl", 2, field)
    assert message in error.message


def test_line_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.submit.request_file as request_file

    monkeypatch.setattr(request_file, "MAX_LINE_BYTES", 100)
    with pytest.raises(RequestFileError, match=r"big.jsonl:1: line is \d+ bytes, over the limit of 100"):
        parse_lines([_line(metadata={"a": "b" * 200})], path="big.jsonl")


def test_password_urls_work_and_wrong_passwords_fail_fast(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", port=free_port(), password="pw-123")
    url = server.ensure_started()
    try:
        assert url == f"redis://:pw-123@127.0.0.1:{server.port}/0"
        assert connect_redis(url).ping()
        with pytest.raises(redis.AuthenticationError):
            connect_redis(f"redis://:wrong@127.0.0.1:{server.port}/0").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()  # protected: no anonymous access
        assert redacted(url) == f"redis://:***@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def test_tls_and_password_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REDIS_TLS_CA", "/etc/ca.pem")
    monkeypatch.setenv("PIPELINE_REDIS_TLS_CERT", "/etc/client.pem")
    monkeypatch.setenv("PIPELINE_REDIS_TLS_KEY", "/etc/client.key")
    monkeypatch.setenv("PIPELINE_REDIS_PASSWORD", "from-env")
    kwargs = client_kwargs("rediss://redis.example:6380/0")
    assert kwargs["ssl_ca_certs"] == "/etc/ca.pem" and kwargs["ssl_certfile"] == "/etc/client.pem"
    assert kwargs["ssl_keyfile"] == "/etc/client.key" and kwargs["password"] == "from-env"
    client = redis.Redis.from_url("rediss://redis.example:6380/0", **kwargs)
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert "password" not in client_kwargs("redis://:inurl@h:1/0")  # the URL's own password wins
    assert "ssl_ca_certs" not in client_kwargs("redis://h:1/0")
    with pytest.raises(ValueError, match="use redis://, rediss://"):
        client_kwargs("http://h:1/0")
    assert redacted("unix:///s.sock?password=abc&db=0") == "unix:///s.sock?password=***&db=0"

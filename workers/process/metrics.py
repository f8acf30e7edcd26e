"""Prometheus metrics of one worker process (`pipeline worker --metrics-port PORT`).

Every worker owns a `WorkerMetrics` with its own `CollectorRegistry` (never the global one,
so several workers in one process, as in the tests, do not clash); every series carries the
labels `worker` (the worker id) and `engine` (the engine's name). The HTTP endpoint
(`/metrics`, prometheus_client's own server) is optional and binds to 127.0.0.1 unless told
otherwise: metrics name jobs, runs and models, and belong on a private network.

What is counted, and where the worker reports it:

- `pipeline_worker_rollouts_total`, `..._completion_tokens_total`, `..._prompt_tokens_total`:
  rows (one per sample) and tokens of every committed shard, from the job's summary;
- `pipeline_worker_jobs_total{outcome}`: `finished`, `failed` (for good: no retry left),
  `retried` (an attempt failed and RQ queued the job again) and `handed_back` (a started job
  given back for another worker without spending a retry: engine failure, second SIGTERM);
  jobs handed back before they started (paused, `min_weight_version`) are not counted;
- `pipeline_worker_engine_errors_total{source}`: `job` (a job failed because the engine was
  unreachable or kept failing) and `probe` (a failed health probe while unhealthy);
- `pipeline_worker_batch_seconds`: engine time of each finished job (histogram);
- `pipeline_worker_queue_wait_seconds`: from the trainer's submit to this worker starting the
  job (histogram; hand-backs and retries start the clock anew only at the next start);
- `pipeline_worker_weight_version`: the weights the engine serves;
- `pipeline_worker_state{state}`: 1 for the current registry state, 0 for the others.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from pipeline.core import settings
from schemas.worker_info import WorkerState
from workers.jobs.work import Work

log = logging.getLogger(__name__)

ENV_METRICS_PORT = settings.METRICS_PORT.name
DEFAULT_METRICS_HOST = "127.0.0.1"

STATES: tuple[str, ...] = get_args(WorkerState)
OUTCOMES = ("finished", "failed", "retried", "handed_back", "canceled")
ENGINE_ERROR_SOURCES = ("job", "probe")
# Batches run from milliseconds (sim) to many minutes (long reasoning rollouts).
BATCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)


class MetricsEndpoint:
    """The optional `/metrics` HTTP endpoint of a registry of one worker's metrics."""

    registry: CollectorRegistry
    worker_id: str
    _server: Any = None
    _server_thread: threading.Thread | None = None
    host: str | None = None
    port: int | None = None

    def serve(self, port: int, host: str = DEFAULT_METRICS_HOST) -> int:
        """Serve /metrics on host:port (0: a free port); return the port bound, also in `self.port`."""
        if self._server is not None:
            raise RuntimeError(f"metrics already served on {self.host}:{self.port}")
        self._server, self._server_thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._server.server_port)
        log.info("worker %s: metrics on http://%s:%d/metrics", self.worker_id, _url_host(host), self.port)
        return self.port

    @property
    def url(self) -> str | None:
        if self.port is None or self.host is None:
            return None
        return f"http://{_url_host(self.host)}:{self.port}/metrics"

    def close(self) -> None:
        """Stop the endpoint (if served); the metrics themselves stay readable in `registry`."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            if self._server_thread is not None:
                self._server_thread.join(timeout=5)
            self._server_thread = None


class WorkerMetrics(MetricsEndpoint):
    """The metrics of one worker, in a registry of their own; thread-safe (prometheus_client is)."""

    def __init__(self, worker_id: str, engine: str) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("worker", "engine")
        r = self.registry
        self._rollouts = Counter("pipeline_worker_rollouts", "Rollout rows (one per sample) committed",
                                 labels, registry=r)
        self._completion_tokens = Counter("pipeline_worker_completion_tokens", "Completion tokens committed",
                                          labels, registry=r)
        self._prompt_tokens = Counter("pipeline_worker_prompt_tokens",
                                      "Prompt tokens of the committed rows (counted once per sample)",
                                      labels, registry=r)
        self._jobs = Counter("pipeline_worker_jobs",
                             "Jobs by outcome: finished, failed, retried, handed_back, canceled",
                             (*labels, "outcome"), registry=r)
        self._engine_errors = Counter("pipeline_worker_engine_errors",
                                      "Engine failures: a job's (source=job) or a health probe's (source=probe)",
                                      (*labels, "source"), registry=r)
        self._batch_seconds = Histogram("pipeline_worker_batch_seconds", "Engine time of each finished job",
                                        labels, buckets=BATCH_BUCKETS, registry=r)
        self._queue_wait = Histogram("pipeline_worker_queue_wait_seconds",
                                     "From submission to this worker starting the job",
                                     labels, buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self._weight_version = Gauge("pipeline_worker_weight_version", "Weight version the engine serves",
                                     labels, registry=r)
        self._state = Gauge("pipeline_worker_state", "1 for the worker's current state, 0 for the others",
                            (*labels, "state"), registry=r)
        # Every labelled series exists from the start (at 0), so rates and alerts see them.
        for outcome in OUTCOMES:
            self._jobs.labels(worker_id, engine, outcome)
        for source in ENGINE_ERROR_SOURCES:
            self._engine_errors.labels(worker_id, engine, source)
        for counter in (self._rollouts, self._completion_tokens, self._prompt_tokens):
            counter.labels(worker_id, engine)
        self._lock = threading.Lock()
        self._current_state: str | None = None
        self.set_state("starting")

    # -- observations ------------------------------------------------------------------------

    def job_finished(self, summary: Any) -> None:
        """A job committed its shard; `summary` is the job function's return value."""
        self._jobs.labels(self.worker_id, self.engine, "finished").inc()
        if not isinstance(summary, dict):
            return
        self._rollouts.labels(self.worker_id, self.engine).inc(int(summary.get("rows", 0)))
        self._completion_tokens.labels(self.worker_id, self.engine).inc(int(summary.get("tokens", 0)))
        self._prompt_tokens.labels(self.worker_id, self.engine).inc(int(summary.get("prompt_tokens", 0)))
        seconds = summary.get("seconds")
        if isinstance(seconds, int | float) and seconds >= 0:
            self._batch_seconds.labels(self.worker_id, self.engine).observe(seconds)

    def job_failed(self, *, retried: bool = False) -> None:
        """An attempt failed: for good, or (`retried`) RQ queued the job again."""
        self._jobs.labels(self.worker_id, self.engine, "retried" if retried else "failed").inc()

    def job_canceled(self) -> None:
        self._jobs.labels(self.worker_id, self.engine, "canceled").inc()

    def job_handed_back(self) -> None:
        self._jobs.labels(self.worker_id, self.engine, "handed_back").inc()

    def engine_error(self, source: str = "job") -> None:
        self._engine_errors.labels(self.worker_id, self.engine, source).inc()

    def job_started(self, queue_wait_s: float | None) -> None:
        if queue_wait_s is not None:
            self._queue_wait.labels(self.worker_id, self.engine).observe(max(0.0, queue_wait_s))

    def set_weight_version(self, version: int) -> None:
        self._weight_version.labels(self.worker_id, self.engine).set(version)

    def set_state(self, state: str) -> None:
        with self._lock:
            if state == self._current_state:
                return
            self._current_state = state
            for name in STATES:
                self._state.labels(self.worker_id, self.engine, name).set(1 if name == state else 0)


class RewardMetrics(MetricsEndpoint):
    """The metrics of one reward worker (`pipeline reward-worker --metrics-port PORT`), labelled `worker`:
    `pipeline_reward_jobs_total{outcome}` (`scored`; `failed`: the function raised or is not registered
    here), `pipeline_reward_rows_total` (rows scored) and `pipeline_reward_shard_seconds` (reading,
    scoring and writing one shard)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.registry = CollectorRegistry(auto_describe=True)
        self._jobs = Counter("pipeline_reward_jobs", "Jobs whose rewards were recorded, by outcome: scored, failed",
                             ("worker", "outcome"), registry=self.registry)
        self._rows = Counter("pipeline_reward_rows", "Rows scored", ("worker",), registry=self.registry)
        self._seconds = Histogram("pipeline_reward_shard_seconds", "Reading, scoring and writing one shard",
                                  ("worker",), buckets=BATCH_BUCKETS, registry=self.registry)
        for outcome in ("scored", "failed"):
            self._jobs.labels(worker_id, outcome)
        self._rows.labels(worker_id)

    def scored(self, rows: int, seconds: float) -> None:
        self._jobs.labels(self.worker_id, "scored").inc()
        self._rows.labels(self.worker_id).inc(rows)
        self._seconds.labels(self.worker_id).observe(seconds)

    def failed(self) -> None:
        self._jobs.labels(self.worker_id, "failed").inc()


def queue_wait_s(work: Work) -> float | None:
    """Seconds since the trainer submitted `work` (its payload's `submitted_at_ms`; else its enqueue time)."""
    payload = work.payload
    submitted_ms = payload.get("submitted_at_ms") if isinstance(payload, dict) else None
    if isinstance(submitted_ms, int | float) and not isinstance(submitted_ms, bool):
        return time.time() - submitted_ms / 1000
    enqueued = work.enqueued_at
    if isinstance(enqueued, datetime):
        return (datetime.now(UTC) - enqueued).total_seconds()
    return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

"""One trace per episode: an OpenTelemetry span around its attempts when an exporter is configured
(the `opentelemetry-sdk` set up by the deployment), nothing when not. The trace id is the span's
when it is recorded, else a fresh random one of the same form (32 hex digits); it goes into the
session's metadata (so every turn row of the episode joins to it) and into the outcome."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from schemas.episode import EpisodeJob


@contextlib.contextmanager
def episode_span(job: EpisodeJob) -> Iterator[str]:
    try:
        from opentelemetry import trace
    except ImportError:
        yield uuid.uuid4().hex
        return
    tracer = trace.get_tracer("rollout-pipeline.agents")
    attributes = {"pipeline.run": job.run, "pipeline.episode": job.episode_id, "pipeline.agent": job.agent,
                  "pipeline.task_id": job.task_id}
    with tracer.start_as_current_span("episode", attributes=attributes) as span:
        context = span.get_span_context()
        yield format(context.trace_id, "032x") if context.is_valid else uuid.uuid4().hex

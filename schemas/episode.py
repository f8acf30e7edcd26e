"""An agent episode as a job: one task × sample of a run, the agent that runs it, its limits, and
what became of it.

A task is any JSON object (a line of a tasks file, a row of a dataset); its `id` (a string or an
integer, unique in the file) names it, else its line or row number does. `pipeline submit
tasks.jsonl --agent pkg.mod:solve --n 8` enqueues one `EpisodeJob` per task × sample; an agent
worker runs it and commits one `EpisodeOutcome`, exactly once per `episode_id`
(`{task_id}:{sample}`), whatever dies.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from schemas.adapters import AdapterName

# An agent is named `package.module:attribute` (what the worker imports).
AGENT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_EPISODE_TIMEOUT_S = 600.0
DEFAULT_EPISODE_RETRIES = 2
MAX_EPISODE_RETRIES = 20


def check_agent_path(path: str, what: str = "agent") -> str:
    if not isinstance(path, str) or not AGENT_PATH.match(path):
        raise ValueError(f"{what} {path!r} is not package.module:function (e.g. my_agents.math:solve)")
    return path


class EpisodeLimits(BaseModel):
    """What an episode may take: wall time per attempt, model calls, attempts after the first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: Annotated[float, Field(gt=0)] | None = DEFAULT_EPISODE_TIMEOUT_S
    max_turns: Annotated[StrictInt, Field(ge=1)] | None = None
    retries: Annotated[StrictInt, Field(ge=0, le=MAX_EPISODE_RETRIES)] = DEFAULT_EPISODE_RETRIES


class EpisodeJob(BaseModel):
    """One task × sample, as it travels through Redis (JSON, never pickle)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: StrictStr
    pool: StrictStr
    agent: StrictStr
    task_id: StrictStr
    sample: Annotated[StrictInt, Field(ge=0)]
    group_size: Annotated[StrictInt, Field(ge=1)]
    group_index: Annotated[StrictInt, Field(ge=0)]  # the task's place in the submit (staleness admission)
    task: dict[str, Any]
    limits: EpisodeLimits = EpisodeLimits()
    submitted_at_ms: StrictInt
    adapter: AdapterName | None = None  # every turn of the episode runs on this LoRA adapter

    @field_validator("agent")
    @classmethod
    def _agent(cls, value: str) -> str:
        return check_agent_path(value)

    @property
    def episode_id(self) -> str:
        return episode_id(self.task_id, self.sample)


def episode_id(task_id: str, sample: int) -> str:
    return f"{task_id}:{sample}"


class EpisodeOutcome(BaseModel):
    """What became of an episode: finished with a reward, or failed with its reason, after `attempts`."""

    model_config = ConfigDict(extra="forbid")

    episode_id: StrictStr
    task_id: StrictStr
    sample: StrictInt
    status: Literal["finished", "failed", "canceled"]
    reward: float | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    reason: StrictStr | None = None
    session_id: StrictStr | None = None  # the session holding the committed attempt's turns
    attempts: StrictInt = 1
    turns: StrictInt = 0
    trace_id: StrictStr
    worker_id: StrictStr
    started_at_ms: StrictInt
    finished_at_ms: StrictInt

"""The `workers` package's errors: a branch of the one tree drawn in `pipeline.core.errors`."""

from __future__ import annotations

from pipeline.core.errors import PipelineError


class WorkerError(PipelineError):
    """Base class of every error a worker raises on purpose; the job fails with its message."""


class UnsupportedRequestError(WorkerError):
    """A job asks for something this worker cannot serve (top-k, routed experts, stop strings, a LoRA
    adapter it cannot load): handed back for another worker, never served without it."""


class ContractViolation(WorkerError):
    """An engine's output breaks an invariant; it is never written as a row."""


class EngineUnavailableError(WorkerError):
    """The engine cannot be loaded or reached."""


class NotAllowedJobError(WorkerError):
    """A job names a function that is not one of the project's own."""


class JobCanceledError(WorkerError):
    """The job was canceled (`pipeline.runs.cancel`): it writes no shard and commits nothing."""


class ShardWriteError(WorkerError):
    """A shard could not be written; nothing was committed."""


class WeightsRefusedError(WorkerError):
    """The worker cannot load its pool's desired weights, so it does not join the pool."""


class CheckpointError(WorkerError):
    """A job's checkpoint in Redis does not decode."""


class EpisodeError(WorkerError):
    """An agent episode's attempt failed: `reason` says why, `retry` whether another attempt may help
    (an error or a timeout may; a reward that is not a number, or too many turns, will not)."""

    def __init__(self, reason: str, *, retry: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry

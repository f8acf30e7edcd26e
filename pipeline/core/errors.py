"""Every error the rollout pipeline raises on purpose, in one tree; each says what, where and what to do.

    PipelineError                      root: catch this to catch them all (workers' errors too)
    ├── RequestFileError               invalid request lines, located; nothing was enqueued
    ├── DatasetError                   invalid dataset rows (row index, column) or column mapping; nothing enqueued
    ├── ColumnMappingError             a dataset column mapping names a missing column or one of the wrong type
    ├── RenderError                    a chat line cannot be rendered (`field` locates it)
    ├── PolicyError                    a weight path or output URL outside what the deployment allows
    ├── RedisURLError                  a Redis URL this pipeline cannot use (also a ValueError)
    ├── EmbeddedRedisError             the embedded Redis server could not be found or started
    ├── PoolNameError                  a pool name that cannot name Redis keys
    ├── RewardNameError                a reward function name that is not registered here
    ├── AgentImportError               an agent or environment path that does not import as a callable
    ├── CapabilityError                no live worker can serve what the requests ask for
    ├── ControlAuthError               the stored control state is malformed, unsigned or forged
    ├── ControlSecretError             $PIPELINE_CONTROL_SECRET_FILE names a file that cannot be read, or is empty
    ├── WeightVersionError             a push named a version not newer than the current one
    ├── WeightPushError                workers failed to load pushed weights or did not acknowledge
    │   └── AdapterPushError           workers failed to read a pushed adapter version or did not acknowledge
    ├── AdapterError                   a LoRA adapter that cannot be pushed or named (not PEFT, misfit, unknown)
    ├── JobsFailedError                some jobs of a batch failed (`failures`: job id -> reason)
    ├── WaitTimeoutError               a wait ran out of time before the batch finished
    ├── NoShardsError                  a run or URL has no shards; names what is there ("did you mean")
    ├── UnknownRunError                no job was ever submitted to a run of that name ("did you mean")
    ├── IncompleteBatchError           `Batch.read()` before every job ended (`partial=True` reads so far)
    ├── WriteLostError                 a write is not on the master named after a failover (lost with the old one)
    │   └── SubmitLostError            a submit's whole batch was lost that way: nothing of it will run
    ├── pipeline.serve.api_error.APIError   `pipeline serve`'s answer other than 200 (OpenAI's error format)
    ├── WeightStoreError               a weight store's content cannot be read or written (also a ValueError)
    │   ├── StoreError                 the store cannot give or take what was asked (store, version, tensor)
    │   │   └── WeightsMismatchError   tensors still not the trainer's bits after a full rebuild
    │   ├── ManifestError              a version's manifest is not a valid record (file, field)
    │   ├── SafetensorsError           a stored file that is not valid safetensors (file, what)
    │   └── CorruptDeltaError          a stored delta that does not decode to the tensor it changes
    └── workers.errors.WorkerError     raised in worker processes; the job fails with its message
        ├── UnsupportedRequestError    a job asks for something this worker cannot serve
        ├── ContractViolation          an engine's output breaks an invariant; never written
        ├── EngineUnavailableError     the engine cannot be loaded or reached
        ├── NotAllowedJobError         a job names a function or output that is not allowed
        ├── JobCanceledError           the job was canceled; no shard, no commit
        ├── ShardWriteError            a shard could not be written; nothing was committed
        ├── WeightsRefusedError        the pool's weights do not load here: the worker does not join
        ├── CheckpointError            a job's checkpoint in Redis does not decode
        └── EpisodeError               an agent episode's attempt failed (its reason; whether to retry)

Outside the tree on purpose: `schemas.control.ControlMessageError` (a `ValueError`, as
`schemas` imports nothing of ours; `pipeline` turns it into `ControlAuthError` before it
reaches a caller), and `pipeline.core.weights.codec_core.DecodeError` (a `ValueError`: that module
imports only numpy, zstandard and xxhash, since the vLLM worker extension loads it by path inside
vLLM's process; `pipeline.core.weights.codec` turns it into `CorruptDeltaError`).

The ones a caller of the public API catches are importable from `pipeline` too. The command line maps them to exit codes
(`pipeline.cli.main.exit_code`, listed in the README).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.control import DesiredState, WeightAck


class PipelineError(Exception):
    """Base class of every error the pipeline raises on purpose."""


# The `path` of requests given as a Python list: located as `requests[i]` (0-based), not as lines.
REQUESTS = "requests"


@dataclass(frozen=True)
class LineError:
    """One problem in a request file, located by line and field (or in a Python list, by index)."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{REQUESTS}[{self.line}]" if self.path == REQUESTS else f"{self.path}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class RequestFileError(PipelineError):
    """A request file has invalid lines; nothing from it was enqueued."""

    def __init__(self, path: str, errors: list[LineError], total_lines: int) -> None:
        self.path = path
        self.errors = errors
        self.total_lines = total_lines
        shown = "\n".join(f"  {e}" for e in errors[:50])
        more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
        bad = len({e.line for e in errors})
        what = ("entry" if bad == 1 else "entries") if path == REQUESTS else "line(s)"
        problems = f" ({len(errors)} problems)" if len(errors) != bad else ""
        super().__init__(
            f"{path}: {bad} invalid {what}{problems}; nothing was enqueued. Fix these and submit "
            f"again:\n{shown}{more}"
        )


@dataclass(frozen=True)
class RowError:
    """One problem in a dataset, located by 0-based row index (as Arrow and pandas count) and column."""

    path: str
    row: int
    column: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: row {self.row}"
        return f"{where}: column {self.column!r}: {self.message}" if self.column else f"{where}: {self.message}"


class DatasetError(PipelineError):
    """A dataset's rows or its column mapping are invalid; nothing from it was enqueued.

    `errors` holds at most `MAX_LISTED` problems; `count` is how many were found in all."""

    MAX_LISTED = 20

    def __init__(self, path: str, errors: list[RowError], count: int, total_rows: int) -> None:
        self.path = path
        self.errors = errors[: self.MAX_LISTED]
        self.count = count
        self.total_rows = total_rows
        shown = "\n".join(f"  {e}" for e in self.errors)
        more = f"\n  ... and {count - len(self.errors)} more" if count > len(self.errors) else ""
        super().__init__(
            f"{path}: {count} problem(s) in {total_rows} rows; nothing was enqueued. Fix these and submit "
            f"again:\n{shown}{more}"
        )


class ColumnMappingError(PipelineError):
    """A column mapping names a column the dataset lacks, or one of the wrong type; nothing was enqueued."""


class RenderError(PipelineError):
    """A chat line cannot be rendered; `field` locates the problem in the line."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class PolicyError(PipelineError):
    """A weight path or output URL outside what this deployment allows."""


class RedisURLError(PipelineError, ValueError):
    """A Redis URL this pipeline cannot use."""


class EmbeddedRedisError(PipelineError):
    """The embedded Redis server could not be found or started."""


class PoolNameError(PipelineError):
    """A pool name that is not 1-64 letters, digits, '_' or '-' starting with a letter or digit."""


class RewardNameError(PipelineError):
    """A reward function name that is not registered (`pipeline.core.rewards`)."""


class AgentImportError(PipelineError):
    """An agent or environment path (`package.module:function`) that does not import as a callable."""


class CapabilityError(PipelineError):
    """No live worker can serve what the requests ask for."""


class ControlAuthError(PipelineError):
    """The stored desired state is malformed, unsigned or forged; it is not obeyed."""


class ControlSecretError(PipelineError):
    """`$PIPELINE_CONTROL_SECRET_FILE` names a file that cannot be read, or an empty one: signing with
    no key would run the deployment unsigned, so nothing starts."""


class WeightVersionError(PipelineError):
    """A push named a weight version not newer than the current one (and was not forced)."""


class WeightPushError(PipelineError):
    """Some live workers failed to load the pushed weights or did not acknowledge in time."""

    def __init__(
        self, version: int, failed: dict[str, str], timed_out: list[str], acks: list[WeightAck],
        *, rolled_back: DesiredState | None = None,
    ) -> None:
        # The pool's desired state after a push no worker took was undone (None: the push stands).
        self.rolled_back = rolled_back
        if rolled_back is not None:
            outcome = (f"no worker loaded it: nothing changed, the pool's weights are still "
                       f"v{rolled_back.weight_version} ({rolled_back.weight_path or 'as the workers started'}); "
                       f"version {version} can be pushed again")
        else:
            outcome = (f"the push stands: the workers named take no job until they load v{version} "
                       "(`pipeline weights status`; re-push with --force to retry)")
        self._answers(f"weight push of version {version}", version, failed, timed_out, acks, outcome)

    def _answers(self, what: str, version: int, failed: dict[str, str], timed_out: list[str], acks: list[WeightAck],
                 outcome: str) -> None:
        self.version = version
        self.failed = failed
        self.timed_out = timed_out
        self.acks = acks
        lines = [f"  {worker}: failed: {reason}" for worker, reason in sorted(failed.items())]
        lines += [f"  {worker}: no acknowledgement (timed out)" for worker in timed_out]
        PipelineError.__init__(self, f"{what}: {len(failed)} worker(s) failed, {len(timed_out)} timed out:\n"
                               + "\n".join([*lines, outcome]))


class AdapterPushError(WeightPushError):
    """Some live workers serving adapters could not read or check a pushed adapter version, or did
    not acknowledge it in time (exit codes as for `WeightPushError`)."""

    def __init__(self, name: str, version: int, failed: dict[str, str], timed_out: list[str], acks: list[WeightAck],
                 *, rolled_back_to: int | None, undone: bool) -> None:
        self.name = name
        # The push was undone (no worker took it): the registry names `rolled_back_to` again (None: no version).
        self.undone = undone
        self.rolled_back_to = rolled_back_to
        self.rolled_back = None
        if undone:
            before = "no version" if rolled_back_to is None else f"v{rolled_back_to}"
            outcome = (f"no worker took it: nothing changed, adapter {name!r} is back at {before}; push it again "
                       "once the workers can read the adapter's store")
        else:
            outcome = (f"the push stands: the workers named hand jobs naming {name!r} back until they can read "
                       f"v{version} (`pipeline weights status`)")
        self._answers(f"adapter push of {name} v{version}", version, failed, timed_out, acks, outcome)


class JobsFailedError(PipelineError):
    """Some jobs of a batch failed."""

    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = failures
        lines = "\n".join(f"  {job_id}: {reason}" for job_id, reason in failures.items())
        super().__init__(f"{len(failures)} job(s) failed:\n{lines}")


class WaitTimeoutError(PipelineError):
    """A wait ran out of time before the batch finished."""


class NoShardsError(PipelineError):
    """A run or URL has no shards at all; the message names what was looked for and what is there."""


class UnknownRunError(PipelineError):
    """No job was ever submitted to the run named (a typo, or another Redis); says which runs exist."""


class IncompleteBatchError(PipelineError):
    """`Batch.read()` while jobs are still queued or running; `read(partial=True)` reads what is committed."""


class WriteLostError(PipelineError):
    """A write the pipeline was about to report as done is not on the Redis master the sentinels name
    now: the master that took it failed over (or was demoted) before any replica had it
    (`pipeline.core.broker.replication`). Callers write again where that is safe (commits, control changes,
    acknowledgements)."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what}: lost in a Redis failover (the master that took it is gone and the new master "
                         "does not have it)")


class SubmitLostError(WriteLostError):
    """A submit's batch was enqueued on a Redis master that failed over before any replica had it, and
    the new master has none of it: nothing of that batch will run, and submitting again duplicates
    nothing. `submit_requests`, `submit_file` and `submit_dataset` do that themselves a few times."""

    def __init__(self, batch_id: str, run: str) -> None:
        self.batch_id = batch_id
        self.run = run
        WriteLostError.__init__(self, f"batch {batch_id} of run {run!r}")
        self.args = (f"batch {batch_id} of run {run!r} was enqueued on a Redis master that failed over before any "
                     "replica had it; the new master has none of it, so nothing of it will run: submit again "
                     "(nothing is duplicated)",)


class AdapterError(PipelineError):
    """A LoRA adapter that cannot be pushed (not a PEFT adapter, or not fitting the base model: names the
    module) or named (no such adapter in the pool: names those that exist, "did you mean")."""


class WeightStoreError(PipelineError, ValueError):
    """A weight store's content (`pipeline.weights`) cannot be read or written as asked."""


class StoreError(WeightStoreError):
    """A store that cannot give or take what was asked; says which store, version and tensor."""


class WeightsMismatchError(StoreError):
    """The tensors do not hold the trainer's bits after a full rebuild (a corrupt store, a bug)."""


class ManifestError(WeightStoreError):
    """A manifest that is not a valid record; says which file and field."""


class SafetensorsError(WeightStoreError):
    """A file that is not valid safetensors; says which file and what."""


class CorruptDeltaError(WeightStoreError):
    """A stored blob that does not decode to the tensor it claims to change."""

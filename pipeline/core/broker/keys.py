"""Names of the Redis keys and RQ queues the pipeline uses, in one place.

Pools: a pool is a name (`[A-Za-z0-9][A-Za-z0-9_-]*`, at most 64 characters; default
`default`, or `$PIPELINE_POOL`) that owns a queue, a desired control state, a wake-up channel,
weight acknowledgements, a worker registry and a set of runs. `pool(name)` gives its keys.

The `default` pool keeps the names of the single-pool releases (`rollouts`,
`pipeline:control:state`, `pipeline:workers`, ...), so data written before pools existed is the
default pool's as it stands: no migration, and workers of the previous release keep serving it
during a rolling upgrade. Every other pool lives under `pipeline:pool:<name>:` and its queue is
`rollouts.<name>`; pool names hold neither ':' nor '.', so no two pools' keys can be the same
and none can be a default-pool key. Runs, batches, commit logs and staged prompt ids are keyed
by run name or by unique batch/job ids and stay global: a run name is the user's namespace
already (it is also the shard directory under the output URL).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.core import settings
from pipeline.core.errors import PoolNameError
from schemas.worker_info import DEFAULT_POOL

PREFIX = "pipeline"
TURN_RATE_BUCKET_S = 10  # agent turns are counted per bucket of this many seconds (`PoolKeys.turns_in`)
QUEUE_NAME = "rollouts"
ENV_POOL = settings.POOL.name
# Every pool ever named by a submit, a worker or a control change (status lists them).
POOLS = f"{PREFIX}:pools"
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class PoolKeys:
    """The Redis keys of one pool."""

    name: str

    @property
    def _base(self) -> str:
        return PREFIX if self.name == DEFAULT_POOL else f"{PREFIX}:pool:{self.name}"

    @property
    def queue_name(self) -> str:
        """The pool's RQ queue."""
        return QUEUE_NAME if self.name == DEFAULT_POOL else f"{QUEUE_NAME}.{self.name}"

    @property
    def lane(self) -> str:
        """The pool's shared lane: a stream of the jobs of agent turns (`pipeline serve`) routed to no
        worker in particular, read by every live worker of the pool through `TURN_GROUP` beside its own
        turn queue (`pipeline.core.jobs.turn_queue`), so a turn never waits behind a batch run."""
        return f"{self._base}:lane"

    @property
    def open_sessions(self) -> str:
        """The set of the pool's open agent sessions (`pipeline serve`)."""
        return f"{self._base}:sessions:open"

    def turn_queue(self, worker_id: str) -> str:
        """One worker's turn queue: a stream of the jobs of turns routed to it (session affinity,
        `pipeline.core.affinity`; `pipeline.core.jobs.turn_queue`), read through `TURN_GROUP`."""
        return f"{self._base}:turn-queue:{worker_id}"

    @property
    def turn_queue_owners(self) -> str:
        """The set of workers with a turn queue: a dead one's is read by the live ones until it is empty."""
        return f"{self._base}:turn-queues"

    def homed_sessions(self, worker_id: str) -> str:
        """A sorted set of the sessions with a turn routed to a worker and not yet answered (member: the
        session id; score: when to forget it): the worker's load (`pipeline.serve.routing`)."""
        return f"{self._base}:homed-sessions:{worker_id}"

    @property
    def turn_stats(self) -> str:
        """A hash of the pool's turn counts: turns, home_turns, cached and prompt tokens, moves by reason."""
        return f"{self._base}:turn-stats"

    def turns_in(self, bucket: int) -> str:
        """A counter of the pool's turns committed in one bucket of `TURN_RATE_BUCKET_S` seconds (the
        bucket: epoch seconds // that), for turns per second in `pipeline status`."""
        return f"{self._base}:turn-rate:{bucket}"

    @property
    def control_state(self) -> str:
        """The pool's desired state (`schemas.control.DesiredState`, signed when a secret is set)."""
        return f"{self._base}:control:state"

    @property
    def control_channel(self) -> str:
        """The pub/sub channel that wakes the pool's workers (a message carries no state)."""
        return f"{self._base}:control:wake"

    def weight_acks(self, version: int) -> str:
        """A hash of worker id → acknowledgement (JSON) of a push of weight `version`."""
        return f"{self._base}:control:acks:{version}"

    @property
    def adapters(self) -> str:
        """A hash of LoRA adapter name → its current version's record (`schemas.adapters.AdapterRecord`)."""
        return f"{self._base}:adapters"

    def adapter_acks(self, name: str) -> str:
        """A hash of worker id → its newest acknowledgement (JSON) of a push of adapter `name`."""
        return f"{self._base}:adapters:acks:{name}"

    @property
    def adapter_versions(self) -> str:
        """A hash of adapter name → the last version number handed to a push (racing pushes get distinct ones)."""
        return f"{self._base}:adapters:versions"

    @property
    def workers(self) -> str:
        """The set of worker ids registered in the pool (entries expire; ids are pruned on read)."""
        return f"{self._base}:workers"

    def worker(self, worker_id: str) -> str:
        """A worker's registry entry (a JSON string with a TTL refreshed by its heartbeat)."""
        return f"{self._base}:worker:{worker_id}"

    @property
    def runs(self) -> str:
        """The set of runs submitted to the pool."""
        return f"{self._base}:runs"

    @property
    def open_batches(self) -> str:
        """The set of the pool's batch ids that may still have jobs to run (every submit adds its
        batch; `workers.jobs.reconcile` drops it once every job has ended)."""
        return f"{self._base}:batches:open"

    def episode_stream(self, agent: str) -> str:
        """The pool's episode queue for one agent (`package.module:function`): a Redis stream, read
        through the consumer group `EPISODE_GROUP` by the agent workers started with that agent."""
        return f"{self._base}:episodes:{agent}"

    @property
    def episode_agents(self) -> str:
        """The set of agents that have an episode stream in the pool."""
        return f"{self._base}:episodes:agents"

    @property
    def agent_workers(self) -> str:
        """The set of the pool's agent worker ids (entries expire; ids are pruned on read)."""
        return f"{self._base}:agent-workers"

    def agent_worker(self, worker_id: str) -> str:
        """An agent worker's registry entry (JSON, with a TTL its heartbeat refreshes)."""
        return f"{self._base}:agent-worker:{worker_id}"

    @property
    def unservable(self) -> str:
        """A hash of job id → why no live worker of the pool can serve it, and since when (JSON)."""
        return f"{self._base}:unservable"


def pool_name(name: str | None = None) -> str:
    """`name`, else `$PIPELINE_POOL`, else `default`; `PoolNameError` if it is not a valid name."""
    chosen = name or settings.pool() or DEFAULT_POOL
    if not _POOL_NAME.match(chosen):
        where = "" if name else f" (from ${ENV_POOL})"
        raise PoolNameError(
            f"pool name {chosen!r}{where} must be 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return chosen


def pool(name: str | None = None) -> PoolKeys:
    """The keys of pool `name` (see `pool_name` for the default)."""
    return PoolKeys(pool_name(name))


def commit_log(run: str) -> str:
    """The per-run Redis stream of committed shards."""
    return f"{PREFIX}:commits:{run}"


def run_jobs(run: str) -> str:
    """A hash of job id → `rows tokens weight_version` of the job's latest commit."""
    return f"{PREFIX}:run:{run}:jobs"


def run_totals(run: str) -> str:
    """A hash of a run's committed totals: shards, rows, tokens, and shards per weight version
    (`shards_v<N>`), kept by `pipeline.core.broker.commit_log.append`."""
    return f"{PREFIX}:run:{run}:totals"


def batch(batch_id: str) -> str:
    """A hash describing one submitted batch (run, output, pool, job ids)."""
    return f"{PREFIX}:batch:{batch_id}"


def run_batches(run: str) -> str:
    """The set of batch ids submitted to a run."""
    return f"{PREFIX}:run:{run}:batches"


def prompts(job_id: str) -> str:
    """A job's prompt token ids as raw little-endian bytes (the fast submit path)."""
    return f"{PREFIX}:prompts:{job_id}"


def checkpoint(job_id: str) -> str:
    """A list of binary pieces: a job's samples in flight, saved by its worker (`workers.jobs.checkpoint`)."""
    return f"{PREFIX}:checkpoint:{job_id}"


def checkpoint_adapters(job_id: str) -> str:
    """The adapter versions a checkpointed job's tokens came from (JSON name -> version; `workers.jobs.checkpoint`)."""
    return f"{PREFIX}:checkpoint:{job_id}:adapters"


def canceled(run: str) -> str:
    """The set of a run's canceled job ids: workers abort them and never commit them (`pipeline.runs.cancel`)."""
    return f"{PREFIX}:run:{run}:canceled"


def run_request_ids(run: str) -> str:
    """The set of every request id submitted into a run: ids are unique in a run, so `rollout_id`s are
    (`pipeline.submit.enqueue`)."""
    return f"{PREFIX}:run:{run}:request_ids"


# Runs submitted with a reward function (`--reward`): the streams reward workers read.
REWARD_RUNS = f"{PREFIX}:rewards:runs"
REPLICATION_PROBE = f"{PREFIX}:replication:probe"  # `pipeline.core.broker.replication` writes it before each WAIT
# The consumer group reward workers share on each such run's commit log.
REWARD_GROUP = "rewards"


def reward_log(run: str) -> str:
    """The per-run stream of committed rewards shards (one entry per job: its rewards or their error)."""
    return f"{PREFIX}:rewards:{run}"


def reward_jobs(run: str) -> str:
    """A hash of job id → `ok` or `failed` once its rewards are committed (each job's rewards once)."""
    return f"{PREFIX}:rewards:{run}:jobs"


def reward_totals(run: str) -> str:
    """A hash of a run's reward totals: jobs, failed, rows, sum (kept by `pipeline.core.broker.reward_log.append`)."""
    return f"{PREFIX}:rewards:{run}:totals"


# Agent sessions (`pipeline serve`): state lives here, so servers are stateless and interchangeable.
def session(session_id: str) -> str:
    """A hash describing one agent session: run, pool, output, metadata, state, reward, versions."""
    return f"{PREFIX}:session:{session_id}"


def session_calls(session_id: str) -> str:
    """A hash of a session's tree of calls (`pipeline.serve.sessions`): each committed call's record,
    each call in flight, the latest call of each request digest, and the index that places a new call
    under the call it extends."""
    return f"{PREFIX}:session:{session_id}:calls"


def session_ends(session_id: str) -> str:
    """A sorted set of the lengths (prompt + completion tokens) of a session's committed choices: the
    prefixes a token-level call is looked up at (`pipeline.serve.sessions`)."""
    return f"{PREFIX}:session:{session_id}:ends"


def serve_inbox(server_id: str) -> str:
    """A server's inbox: a list workers push its turns' answers to (`pipeline.core.jobs.replies`),
    which the server takes in batches and hands to each turn's waiters (`pipeline.serve.inbox`)."""
    return f"{PREFIX}:serve:{server_id}:inbox"


def turn_stream(turn_id: str) -> str:
    """A stream of a streamed turn's tokens as its worker generates them, then an end marker
    (`pipeline.core.jobs.turn_stream`); the server reads it from the start, never consuming it."""
    return f"{PREFIX}:turn:{turn_id}:stream"


def turn_job(turn_id: str) -> str:
    """The id of the job that holds a turn (the server's turns travel in jobs of several), with the
    worker whose turn queue holds it (`pipeline.core.jobs.turn_queue.turn_job_value`)."""
    return f"{PREFIX}:turn:{turn_id}:job"


def turn_failed(turn_id: str) -> str:
    """Why a turn's job failed for good (`pipeline.core.jobs.turn_queue.fail`)."""
    return f"{PREFIX}:turn:{turn_id}:failed"


# Runs with agent turns: the turn logs flushers write to shards.
TURN_RUNS = f"{PREFIX}:turns:runs"


def turn_log(run: str) -> str:
    """A run's stream of agent-turn rows not yet written to a shard (one entry per turn, Arrow IPC)."""
    return f"{PREFIX}:turns:{run}"


def turn_shard(turn_id: str) -> str:
    """The URL of the shard a flushed turn's rows went to (kept a while after the flush: a waiter
    that lost the reply reads them there, and a second run of the turn's job does not log it again)."""
    return f"{PREFIX}:turn:{turn_id}:shard"


def turn_log_jobs(run: str) -> str:
    """A hash of turn id → its turn-log entry id: each turn's rows are logged once."""
    return f"{PREFIX}:turns:{run}:jobs"


def turn_log_output(run: str) -> str:
    """The output URL a run's turn shards are written under (set by the server that opened the run)."""
    return f"{PREFIX}:turns:{run}:output"


def turn_flush_lock(run: str) -> str:
    """Held by the one flusher writing a run's next turn shard."""
    return f"{PREFIX}:turns:{run}:flush-lock"


def run_turn_stats(run: str) -> str:
    """A hash of a run's agent-turn counts: turns, prefix_breaks (`pipeline status`, the report)."""
    return f"{PREFIX}:run:{run}:turn-stats"


# Agent episodes (`pipeline submit --agent`, `pipeline agent-worker`), keyed by run.
EPISODE_GROUP = "agent-workers"
TURN_GROUP = "workers"  # the consumer group of the pool's workers on each turn queue
EPISODE_RUNS = f"{PREFIX}:episodes:runs"


def episode_run(run: str) -> str:
    """A hash describing a run's episodes: agent, pool, samples per task, task ids in order, counts."""
    return f"{PREFIX}:episodes:{run}:run"


def episode_outcomes(run: str) -> str:
    """A hash of episode id → its outcome (JSON), written once per episode: the first commit wins."""
    return f"{PREFIX}:episodes:{run}:outcomes"


def episode_attempts(run: str) -> str:
    """A hash of episode id → its attempt in flight (JSON: attempt, session, worker, started)."""
    return f"{PREFIX}:episodes:{run}:attempts"


def episode_discarded(run: str) -> str:
    """The set of sessions of attempts that will never reach training (retried, or abandoned by a
    worker that died): readers leave their turns out."""
    return f"{PREFIX}:episodes:{run}:discarded"

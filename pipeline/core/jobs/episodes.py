"""The episode job contract: how episodes are queued, claimed, attempted and committed, exactly once.

An episode job (`schemas.episode.EpisodeJob`) is an entry of its pool's stream for its agent
(`keys.PoolKeys.episode_stream`), read through one consumer group (`keys.EPISODE_GROUP`) by the
agent workers started with that agent, with the project's one mechanism for work routed to live
consumers (`pipeline.core.broker.work_streams`, `STREAMS`): Redis hands each entry to one worker,
the worker keeps the entries it holds fresh, and an entry whose holder went silent is taken over
after `claim_after_s`. RQ is not used here: an RQ worker runs one job at a time per process, an
agent worker runs hundreds of episodes at once in one event loop.

Each attempt is recorded before it starts (`start_attempt`): its session, worker and number. A
new attempt discards the session of the one before it (a retry after an error or timeout, or a
take-over after a crash): those turns never reach training (`keys.episode_discarded`, counted as
`retried`, `abandoned` (its worker died) and `handed_back` (its worker shut down: `hand_back`)), and
the discarded session no longer counts as open. An outcome is committed by one script (`commit`) that writes it only
if no outcome exists for the episode and the committing worker holds the attempt in flight, and
acknowledges the entry in the same step; a worker whose episode was taken over commits nothing
(its session is discarded, counted as `duplicates`).

Which attempts reach training is decided in one place, `trained`: the committed attempt of each
finished episode (and of each failed one when the run gives failed episodes a reward), of the tasks
none of whose episodes was canceled. A cancel (`cancel_run`, `EpisodeRun.take`) so takes whole
groups off, never half of one; every trajectory reader and the report apply this rule.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.core.broker import keys, work_streams
from schemas.episode import EpisodeJob, EpisodeOutcome, episode_id

GROUP = keys.EPISODE_GROUP
# The pool's episode streams, one per agent (`keys.PoolKeys.episode_stream`), read through one group.
STREAMS = work_streams.WorkStreams(GROUP, EpisodeJob.model_validate_json)
Claimed = work_streams.Claimed[EpisodeJob]  # an entry an agent worker holds
COUNTS = ("submitted", "finished", "failed", "canceled", "retried", "abandoned", "handed_back", "duplicates")
ENDED = ("finished", "failed", "canceled")  # the statuses of an outcome

# KEYS: attempts, discarded, run hash, outcomes, the pool's open sessions. ARGV: episode id, attempt JSON,
# session id, worker id.
# Returns 0 when the episode has an outcome already (a leftover entry: acknowledge it), else 1 and the
# attempt number to use (one past the last recorded, whoever ran it).
_START = """
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then return {0, 0} end
local previous = redis.call('HGET', KEYS[1], ARGV[1])
local number = 1
local failures = 0
if previous then
  local prev = cjson.decode(previous)
  number = prev.attempt + 1
  failures = prev.failures or 0
  if prev.session_id and prev.session_id ~= ARGV[3] then
    redis.call('SADD', KEYS[2], prev.session_id)
    redis.call('SREM', KEYS[5], prev.session_id)
    if prev.handed_back then
      redis.call('HINCRBY', KEYS[3], 'handed_back', 1)
    elseif prev.worker_id == ARGV[4] then
      redis.call('HINCRBY', KEYS[3], 'retried', 1)
    else
      redis.call('HINCRBY', KEYS[3], 'abandoned', 1)
    end
  end
end
local attempt = cjson.decode(ARGV[2])
attempt.attempt = number
attempt.failures = failures
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(attempt))
return {1, number, failures}
"""

# KEYS: attempts. ARGV: episode id, worker id. An attempt its worker stopped on shutdown: marked, so the
# next attempt counts it as handed back, not abandoned.
_HAND_BACK = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local attempt = cjson.decode(raw)
if attempt.worker_id ~= ARGV[2] then return 0 end
attempt.handed_back = true
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(attempt))
return 1
"""

# KEYS: attempts. ARGV: episode id, worker id. A failed attempt that will be retried: counted.
_FAILED_ATTEMPT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local attempt = cjson.decode(raw)
if attempt.worker_id ~= ARGV[2] then return 0 end
attempt.failures = (attempt.failures or 0) + 1
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(attempt))
return attempt.failures
"""

# KEYS: outcomes, attempts, stream, run hash, discarded. ARGV: episode id, outcome JSON, group, entry id,
# status, session id ('' for none), worker id. Returns 1 when this commit is the episode's outcome.
_COMMIT = """
local attempt = redis.call('HGET', KEYS[2], ARGV[1])
if attempt and cjson.decode(attempt).worker_id ~= ARGV[7] then
  redis.call('HINCRBY', KEYS[4], 'duplicates', 1)
  if ARGV[6] ~= '' then redis.call('SADD', KEYS[5], ARGV[6]) end
  return 0
end
local first = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if first == 1 then
  redis.call('HINCRBY', KEYS[4], ARGV[5], 1)
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  if cjson.decode(redis.call('HGET', KEYS[1], ARGV[1])).status ~= 'canceled' then
    redis.call('HINCRBY', KEYS[4], 'duplicates', 1)  -- an attempt stopped by a cancel is counted there
  end
  if ARGV[6] ~= '' then redis.call('SADD', KEYS[5], ARGV[6]) end
end
redis.call('XACK', KEYS[3], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[3], ARGV[4])
return first
"""


# KEYS: outcomes, attempts, run hash, discarded, the pool's open sessions. ARGV: the session key prefix,
# then pairs of episode id, canceled outcome JSON. Every episode with no outcome yet gets the canceled
# one; an attempt in flight is forgotten: its session discarded and ended (`pipeline serve` starts no
# further turn of it; its worker's late commit finds the outcome and counts nothing). Returns how many.
_CANCEL = """
redis.call('HSET', KEYS[3], 'canceled_run', '1')
local canceled = 0
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    canceled = canceled + 1
    local attempt = redis.call('HGET', KEYS[2], ARGV[i])
    if attempt then
      local session = cjson.decode(attempt).session_id
      if session then
        redis.call('SADD', KEYS[4], session)
        if redis.call('EXISTS', ARGV[1] .. session) == 1 then
          redis.call('HSET', ARGV[1] .. session, 'state', 'ended')
          redis.call('SREM', KEYS[5], session)
        end
      end
      redis.call('HDEL', KEYS[2], ARGV[i])
    end
  end
end
redis.call('HINCRBY', KEYS[3], 'canceled', canceled)
return canceled
"""


@dataclass(frozen=True)
class Attempt:
    number: int  # 1 for the first; one more for each retry or take-over
    failures: int  # attempts before this one that raised or timed out


def start_attempt(conn: redis.Redis, job: EpisodeJob, *, session_id: str, worker_id: str,
                  trace_id: str, started_at_ms: int) -> Attempt | None:
    """Record the attempt about to start (discarding the session of the one before it); None when the
    episode already has an outcome."""
    attempt = {"session_id": session_id, "worker_id": worker_id, "trace_id": trace_id, "started_at_ms": started_at_ms}
    started, number, *failures = conn.eval(
        _START, 5, keys.episode_attempts(job.run), keys.episode_discarded(job.run), keys.episode_run(job.run),
        keys.episode_outcomes(job.run), keys.pool(job.pool).open_sessions, job.episode_id, json.dumps(attempt),
        session_id, worker_id)
    return Attempt(int(number), int(failures[0]) if failures else 0) if started else None


def count_failure(conn: redis.Redis, job: EpisodeJob, worker_id: str) -> int:
    """Count a failed attempt of this worker's (to be retried); returns the failures so far."""
    return int(conn.eval(_FAILED_ATTEMPT, 1, keys.episode_attempts(job.run), job.episode_id, worker_id))


def commit(conn: redis.Redis, claimed: Claimed, outcome: EpisodeOutcome) -> bool:
    """Commit the episode's outcome and acknowledge its entry; False when it was not this worker's to
    commit (taken over, or committed already): then nothing of it counts."""
    job = claimed.job
    return bool(conn.eval(
        _COMMIT, 5, keys.episode_outcomes(job.run), keys.episode_attempts(job.run), claimed.stream,
        keys.episode_run(job.run), keys.episode_discarded(job.run), job.episode_id, outcome.model_dump_json(),
        GROUP, claimed.entry_id, outcome.status, outcome.session_id or "", outcome.worker_id))


def acknowledge(conn: redis.Redis, claimed: Claimed) -> None:
    """Drop an entry whose episode has an outcome already (nothing to run)."""
    with conn.pipeline(transaction=True) as pipe:
        STREAMS.acknowledge(pipe, claimed)
        pipe.execute()


def hand_back(conn: redis.Redis, consumer: str, stopped: list[Claimed]) -> None:
    """Episodes this worker stopped on shutdown: their attempts marked handed back, their entries made
    idle so that any worker takes them over at once (`WorkStreams.take_over`), not after `claim_after_s`."""
    with conn.pipeline(transaction=False) as pipe:
        for claimed in stopped:
            pipe.eval(_HAND_BACK, 1, keys.episode_attempts(claimed.job.run), claimed.job.episode_id, consumer)
            STREAMS.hand_back(pipe, consumer, claimed)
        pipe.execute()


def outcomes(conn: redis.Redis, run: str) -> dict[str, EpisodeOutcome]:
    """Every committed outcome of the run, by episode id."""
    raw = conn.hgetall(keys.episode_outcomes(run))
    return {k.decode(): EpisodeOutcome.model_validate_json(v) for k, v in raw.items()}


def trained(outcomes: Iterable[EpisodeOutcome], failed_reward: float | None) -> list[EpisodeOutcome]:
    """The outcomes whose attempts reach training (each holds its committed session): finished ones, and
    failed ones when `failed_reward` is given, of tasks none of whose episodes was canceled. Retried,
    abandoned and duplicate attempts never are (their sessions are no outcome's)."""
    ended = list(outcomes)
    canceled = {o.task_id for o in ended if o.status == "canceled"}
    return [o for o in ended if o.task_id not in canceled
            and (o.status == "finished" or (o.status == "failed" and failed_reward is not None))]


def is_episode_run(conn: redis.Redis, run: str) -> bool:
    """Whether `run` holds agent episodes (`pipeline submit --agent`)."""
    return bool(conn.exists(keys.episode_run(run)))


def run_info(conn: redis.Redis, run: str) -> dict[str, Any] | None:
    """What submit recorded of a run's episodes (agent, pool, n, task ids, limits), with its counts;
    None for a run with no episodes."""
    raw = conn.hgetall(keys.episode_run(run))
    if not raw:
        return None
    data = {k.decode(): v.decode() for k, v in raw.items()}
    info: dict[str, Any] = json.loads(data.pop("spec", "{}"))
    info["canceled"] = "canceled_run" in data
    info["counts"] = {name: int(data.get(name, 0)) for name in COUNTS}
    info["counts"]["running"] = conn.hlen(keys.episode_attempts(run))
    done = sum(info["counts"][status] for status in ENDED)
    info["counts"]["queued"] = max(0, info["counts"]["submitted"] - done - info["counts"]["running"])
    return info


def cancel_run(conn: redis.Redis, run: str, info: dict[str, Any] | None = None) -> int:
    """Cancel every episode of `run` that has no outcome yet: the queued ones never start, the sessions of
    the ones in flight end at once (no further turn starts), their agent workers stop them (within a
    keep-alive interval), and their tasks' groups never reach training (`trained`). Returns how many
    were canceled (0 for a run with none left, or no episodes)."""
    info = info or run_info(conn, run)  # `info`: the run's `run_info`, when the caller has read it
    if info is None:
        return 0
    now = int(time.time() * 1000)
    pairs: list[str] = []
    for task in info["tasks"]:
        for sample in range(int(info["n"])):
            outcome = EpisodeOutcome(
                episode_id=episode_id(task, sample), task_id=task, sample=sample, status="canceled",
                reason="the run was canceled (pipeline cancel)", attempts=0, trace_id="", worker_id="",
                started_at_ms=now, finished_at_ms=now)
            pairs += [outcome.episode_id, outcome.model_dump_json()]
    return int(conn.eval(_CANCEL, 5, keys.episode_outcomes(run), keys.episode_attempts(run), keys.episode_run(run),
                         keys.episode_discarded(run), keys.pool(info["pool"]).open_sessions, keys.session(""),
                         *pairs))


def canceled_runs(conn: redis.Redis, runs: set[str]) -> set[str]:
    """Which of `runs` were canceled."""
    ordered = sorted(runs)
    with conn.pipeline(transaction=False) as pipe:
        for run in ordered:
            pipe.hexists(keys.episode_run(run), "canceled_run")
        flags = pipe.execute()
    return {run for run, flag in zip(ordered, flags, strict=True) if flag}


def is_canceled(conn: redis.Redis, run: str, episode: str) -> bool:
    """Whether the episode's outcome is `canceled` (`cancel_run`)."""
    raw = conn.hget(keys.episode_outcomes(run), episode)
    return raw is not None and EpisodeOutcome.model_validate_json(raw).status == "canceled"


def discarded_sessions(conn: redis.Redis, run: str) -> set[str]:
    return {s.decode() for s in conn.smembers(keys.episode_discarded(run))}

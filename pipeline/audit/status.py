"""`pipeline status`: per pool, its queue and agent turns, open agent sessions, workers and their
capability classes, jobs no live worker can serve, desired state, runs, shards, agent turns and failures."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from typing import Any

import redis
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from pipeline.core import adapters
from pipeline.core.broker import commit_log, control_channel, keys, registry, reward_log
from pipeline.core.errors import UnknownRunError
from pipeline.core.jobs import episodes, turn_queue
from pipeline.core.jobs.queue import rollout_queue
from pipeline.core.jobs.status import failure_reason
from pipeline.core.suggest import did_you_mean, listing
from schemas.adapters import AdapterRecord
from schemas.capabilities import describe
from schemas.control import DesiredState

FAILURES_SHOWN = 20
RATE_BUCKETS = 6  # agent turns per second are over the last this many whole buckets (a minute)
SESSIONS_READ = 10_000  # open sessions whose versions status reads (one pipeline of HMGETs), at most


def _desired(conn: redis.Redis, pool: str) -> dict[str, Any]:
    try:
        return control_channel.read_state(conn, pool).model_dump()
    except control_channel.ControlAuthError as exc:
        return {**DesiredState().model_dump(), "error": str(exc)}


def unservable(conn: redis.Redis, pool: str) -> dict[str, Any]:
    """Jobs of `pool` waiting for a capability no live worker has: job id → {since, reason}."""
    waiting: dict[str, Any] = {}
    for job_id, raw in conn.hgetall(keys.pool(pool).unservable).items():
        try:
            waiting[job_id.decode(errors="replace")] = json.loads(raw)
        except ValueError:
            continue
    return waiting


def open_sessions(conn: redis.Redis, pool: str, limit: int = SESSIONS_READ) -> dict[str, Any]:
    """The pool's open agent sessions (`pipeline serve`): how many, and the weight versions their
    turns used (each session's min_version..max_version; a session with no turn yet has none).
    Reads at most `limit` sessions (`read`, `capped`) in one pipeline of HMGETs; `expired`: ids
    still in the open set whose session hash expired (`pipeline.serve.sessions.SESSION_TTL_S`)."""
    where = keys.pool(pool)
    count = conn.scard(where.open_sessions)
    ids = conn.srandmember(where.open_sessions, limit) if count else []  # distinct ids, at most `limit`
    with conn.pipeline(transaction=False) as pipe:
        for session_id in ids:
            pipe.hmget(keys.session(session_id.decode()), "run", "min_version", "max_version")
        fields = pipe.execute() if ids else []
    gone = sum(1 for run, _, _ in fields if run is None)
    versions = [(int(low), int(high)) for run, low, high in fields
                if run is not None and low is not None and high is not None]
    return {"open": count, "read": len(ids), "capped": count > len(ids), "expired": gone,
            "with_versions": len(versions), "no_turn_yet": len(ids) - gone - len(versions),
            "weight_versions": [min(low for low, _ in versions), max(high for _, high in versions)]
            if versions else None,
            "mixed_versions": sum(1 for low, high in versions if high > low)}


def affinity(conn: redis.Redis, pool: str) -> dict[str, Any] | None:
    """Where the pool's agent turns ran (`pipeline.core.affinity`), None before its first turn: turns
    per second over the last minute; of the turns of sessions with a home, the share served there;
    prompt tokens, and the share the engines found in their prefix caches (the prefill saved);
    moves of session homes by reason."""
    where = keys.pool(pool)
    stats = {k.decode(): int(v) for k, v in conn.hgetall(where.turn_stats).items()}
    if not stats:
        return None
    now = int(time.time()) // keys.TURN_RATE_BUCKET_S
    counts = conn.mget([where.turns_in(now - 1 - i) for i in range(RATE_BUCKETS)])
    homed = stats.get("homed_turns", 0)
    prompt = stats.get("prompt_tokens", 0)
    return {"turns": stats.get("turns", 0),
            "turns_per_s": round(sum(int(c or 0) for c in counts) / (keys.TURN_RATE_BUCKET_S * RATE_BUCKETS), 1),
            "homed_turns": homed, "home_turns": stats.get("home_turns", 0),
            "home_share": round(stats.get("home_turns", 0) / homed, 4) if homed else None,
            "prompt_tokens": prompt, "cached_tokens": stats.get("cached_tokens", 0),
            "cached_share": round(stats.get("cached_tokens", 0) / prompt, 4) if prompt else None,
            "moves": {k[6:]: v for k, v in sorted(stats.items()) if k.startswith("moves:")}}


def collect(conn: redis.Redis, run: str | None = None, pool: str | None = None) -> dict[str, Any]:
    """Every pool's status (`pools`: name → status), or only `pool`'s when one is named."""
    names = [keys.pool_name(pool)] if pool else registry.pools(conn)
    if run and not any(conn.sismember(keys.pool(name).runs, run) for name in names):
        known = registry.runs(conn)
        where = f"pool {keys.pool_name(pool)!r}" if pool else "any pool"
        raise UnknownRunError(f"no run {run!r} was submitted to {where} in this Redis; runs submitted here: "
                              f"{listing(known)}{did_you_mean(run, known)}")
    return {"pools": {name: collect_pool(conn, name, run) for name in names}}


def queued_turns(conn: redis.Redis, pool: keys.PoolKeys) -> dict[str, Any]:
    """Jobs of agent turns (`pipeline.core.jobs.turn_queue`) in the pool's shared lane (`lane_queued`
    waiting, `lane_taken` taken by a worker) and in its workers' turn queues (`routed` waiting,
    `taken` taken by a worker)."""
    owners = sorted(m.decode() for m in conn.smembers(pool.turn_queue_owners))
    streams = [pool.lane, *(pool.turn_queue(worker) for worker in owners)]
    with conn.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, turn_queue.TURNS.group)
        counts = pipe.execute(raise_on_error=False)
    entries = [c if isinstance(c, int) else 0 for c in counts[0::2]]
    taken = [int(p["pending"]) if isinstance(p, dict) else 0 for p in counts[1::2]]  # a stream without its group
    return {"lane": pool.lane, "lane_queued": entries[0] - taken[0], "lane_taken": taken[0],
            "routed": sum(entries[1:]) - sum(taken[1:]), "taken": sum(taken[1:])}


def collect_pool(conn: redis.Redis, pool: str, run: str | None = None) -> dict[str, Any]:
    """One pool: its desired state, queue, agent turns (`turns`: jobs of turns queued in the shared lane,
    and routed to workers' turn queues: waiting, and taken but not done), open agent
    sessions (`sessions`, see `open_sessions`), live workers and the capability classes they serve, jobs
    waiting for a capability no live worker has (`workers.jobs.admission`), runs and failed jobs."""
    where = keys.pool(pool)
    queue = rollout_queue(conn, where.name)
    failed = FailedJobRegistry(queue=queue, serializer=JSONSerializer)
    started = StartedJobRegistry(queue=queue, serializer=JSONSerializer)
    runs = sorted(m.decode() for m in conn.smembers(where.runs))
    if run:
        runs = [name for name in runs if name == run]
    now = time.time()
    workers = registry.live_workers(conn, where.name)
    # Counts and ids without RQ's cleanup: looking at the status must not retry abandoned jobs.
    failed_ids = failed.get_job_ids(0, FAILURES_SHOWN - 1, cleanup=False)
    desired = _desired(conn, where.name)
    return {
        "desired": desired,
        # retrying: failed jobs waiting out their backoff before they are queued again
        "queue": {"name": queue.name, "queued": queue.count,
                  "retrying": queue.scheduled_job_registry.get_job_count(cleanup=False),
                  "started": started.get_job_count(cleanup=False), "failed": failed.get_job_count(cleanup=False)},
        "turns": queued_turns(conn, where),
        "sessions": open_sessions(conn, where.name),
        "affinity": affinity(conn, where.name),
        "workers": [{**w.model_dump(), "heartbeat_age_s": max(0.0, round(now - w.heartbeat_at, 1))} for w in workers],
        "capability_classes": [
            {"serves": describe(capabilities), "capabilities": capabilities.model_dump(), "workers": count}
            for capabilities, count in Counter(w.capabilities for w in workers).most_common()
        ],
        "unservable": unservable(conn, where.name),
        "agent_workers": agent_workers(conn, where.name),
        "runs": {name: _run(conn, name, desired.get("weight_version", 0)) for name in runs},
        "failed_jobs": failed_ids,
        "failure_reasons": {job_id: failure_reason(conn, job_id) for job_id in failed_ids},
    }


def _run(conn: redis.Redis, run: str, current: int) -> dict[str, Any]:
    """A run's totals and its staleness: how many versions the oldest token it committed is behind
    the pool's latest pushed version (each shard records its oldest token's version)."""
    totals = dataclasses.asdict(commit_log.totals(conn, run))
    versions = totals["weight_versions"]
    return {**totals, "staleness": max(0, current - min(versions)) if versions else None,
            "canceled": conn.scard(keys.canceled(run)),
            "rewards": _rewards(conn, run) if conn.sismember(keys.REWARD_RUNS, run) else None,
            "agent_turns": _agent_turns(conn, run),
            "episodes": _episodes(conn, run)}


def agent_workers(conn: redis.Redis, pool: str) -> list[dict[str, Any]]:
    """The pool's live agent workers (`pipeline agent-worker`), as their heartbeats last wrote them."""
    where = keys.pool(pool)
    ids = sorted(m.decode() for m in conn.smembers(where.agent_workers))
    entries = conn.mget([where.agent_worker(i) for i in ids]) if ids else []
    gone = [i for i, raw in zip(ids, entries, strict=True) if raw is None]
    if gone:
        conn.srem(where.agent_workers, *gone)
    return [json.loads(raw) for raw in entries if raw is not None]


def _episodes(conn: redis.Redis, run: str) -> dict[str, Any] | None:
    """A run's agent episodes: counts and the reasons of the latest failures (None: no episodes)."""
    info = episodes.run_info(conn, run)
    if info is None:
        return None
    outcomes = episodes.outcomes(conn, run).values() if info["counts"]["failed"] else []
    reasons = Counter(o.reason for o in outcomes if o.status == "failed")
    return {"agent": info["agent"], "n": info["n"], "tasks": len(info["tasks"]), **info["counts"],
            "failure_reasons": dict(reasons.most_common(5))}


def _rewards(conn: redis.Redis, run: str) -> dict[str, Any]:
    """A run's reward totals; `scored`: the shards whose rewards were written (`jobs` counts failed ones too)."""
    totals = reward_log.totals(conn, run)
    return {**dataclasses.asdict(totals), "scored": totals.jobs - totals.failed}


def _agent_turns(conn: redis.Redis, run: str) -> dict[str, int] | None:
    """A run's agent turns and prefix breaks (`keys.run_turn_stats`), None when it has no agent turn."""
    stats = conn.hgetall(keys.run_turn_stats(run))
    if not stats:
        return None
    return {"turns": int(stats.get(b"turns", 0)), "prefix_breaks": int(stats.get(b"prefix_breaks", 0))}


def stalled_hint(conn: redis.Redis, run: str) -> str:
    """Why a run's jobs may not be moving, for a wait that ran out of time: its pool is paused,
    has no live worker, or (otherwise) the question to look into."""
    pools = [name for name in registry.pools(conn) if conn.sismember(keys.pool(name).runs, run)]
    for name in pools:
        try:
            if control_channel.read_state(conn, name).paused:
                return f"pool {name!r} is paused: its workers take no job until `pipeline resume --pool {name}`"
        except control_channel.ControlAuthError:
            continue
    for name in pools:
        if not registry.live_workers(conn, name):
            return f"no worker is live in pool {name!r}: start one (`pipeline worker --pool {name}`)"
    return "are workers running? (`pipeline status`)"


def weights(conn: redis.Redis, pool: str | None = None) -> dict[str, Any]:
    """The pool's desired weights and each live worker's actual ones (`converged`: serving them)."""
    name = keys.pool_name(pool)
    desired = _desired(conn, name)
    workers = [
        {"worker_id": w.worker_id, "state": w.state, "weight_version": w.weight_version, "error": w.error,
         "converged": w.weight_version == desired["weight_version"] and not w.error}
        for w in registry.live_workers(conn, name)
    ]
    status = {"pool": name, "desired": {k: desired[k] for k in ("weight_version", "weight_path", "swap_mode",
                                                               "generation", "weight_source")}, "workers": workers}
    if desired["weight_source"] == "store" and desired["weight_path"]:
        from pipeline.core.weights.store import describe

        status["store"] = describe(desired["weight_path"])
    serving = [w.worker_id for w in registry.live_workers(conn, name) if w.capabilities.lora_adapters]
    status["adapters"] = [{**_adapter_status(conn, name, record, serving),
                           "swap_mode": desired["adapter_swap_modes"].get(record.name, "drain")}
                          for record in sorted(adapters.records(conn, name).values(), key=lambda r: r.name)]
    return status


def _adapter_status(conn: redis.Redis, pool: str, record: AdapterRecord, serving: list[str]) -> dict[str, Any]:
    """An adapter's current version and which live workers serving adapters acknowledged it (or failed to)."""
    answers = control_channel.read_adapter_acks(conn, record.name, pool)
    current = {w: answers[w] for w in serving if w in answers and answers[w].version >= record.version}
    return {"name": record.name, "version": record.version, "rank": record.rank,
            "target_modules": record.target_modules, "stored_bytes": record.stored_bytes,
            "acknowledged": sorted(w for w, ack in current.items() if ack.ok),
            "failed": {w: ack.error for w, ack in sorted(current.items()) if not ack.ok},
            "unanswered": sorted(w for w in serving if w not in current)}


def format_weights(status: dict[str, Any]) -> str:
    desired = status["desired"]
    lines = [f"pool {status['pool']}: desired weights v{desired['weight_version']} from "
             f"{desired['weight_path'] or '(none pushed: as the workers started)'} ({desired['swap_mode']}, "
             f"generation {desired['generation']})",
             f"workers: {len(status['workers'])} live"]
    if "store" in status:
        store = status["store"]
        versions = ", ".join(f"v{v['version']} {v['kind']} {v['stored_bytes'] / 1e6:.2f} MB" for v in store["versions"])
        lines.insert(1, f"weight store {store['url']}: {versions or store.get('error') or 'empty'}")
    for w in status["workers"]:
        lines.append(f"  {w['worker_id']}  v{w['weight_version']}  {w['state']:<9} "
                     + ("ok" if w["converged"] else f"BEHIND: {w['error'] or 'not loaded yet'}"))
    if status.get("adapters"):
        lines.append(f"adapters: {len(status['adapters'])} (read and checked by each worker serving adapters at "
                     "the push; loaded by the first batch naming one)")
        for a in status["adapters"]:
            failed = "".join(f"; FAILED on {w}: {error}" for w, error in a["failed"].items())
            unanswered = f"; not answered by {', '.join(a['unanswered'])}" if a["unanswered"] else ""
            partial = ", partial" if a["swap_mode"] == "partial" else ""
            lines.append(f"  {a['name']}  v{a['version']}  rank {a['rank']} on {', '.join(a['target_modules'])}  "
                         f"{a['stored_bytes'] / 1e6:.2f} MB{partial}  acknowledged by "
                         f"{len(a['acknowledged'])} worker(s){failed}{unanswered}")
    return "\n".join(lines)


def format_status(status: dict[str, Any]) -> str:
    return "\n\n".join(format_pool(name, pool) for name, pool in status["pools"].items())


def format_sessions(s: dict[str, Any]) -> str:
    """E.g. `agent sessions: 12 open sessions over weight versions 3..5 (2 with turns on more than one
    version, 4 with no turn yet)`."""
    line = f"agent sessions: {s['open']} open session(s)"
    if s["weight_versions"] is not None:
        low, high = s["weight_versions"]
        line += f" over weight version{'s' if high > low else ''} {low}" + (f"..{high}" if high > low else "")
    notes = [f"{s['mixed_versions']} with turns on more than one version" if s["mixed_versions"] else "",
             f"{s['no_turn_yet']} with no turn yet" if s["no_turn_yet"] else "",
             f"{s['expired']} whose state has expired" if s["expired"] else "",
             f"counts and versions from a random {s['read']} of them" if s["capped"] else ""]
    notes = [n for n in notes if n]
    return line + (f" ({', '.join(notes)})" if notes else "")


def format_affinity(a: dict[str, Any]) -> str:
    """`affinity` as one line: rate, home share, prefill saved, moves."""
    home = "-" if a["home_share"] is None else f"{a['home_share']:.1%}"
    cached = "-" if a["cached_share"] is None else f"{a['cached_share']:.1%}"
    moves = ", ".join(f"{n} {why}" for why, n in a["moves"].items()) or "none"
    return (f"agent turns: {a['turns']} ({a['turns_per_s']:g}/s over the last minute); {home} of "
            f"{a['homed_turns']} on their session's home worker; {a['cached_tokens']} of {a['prompt_tokens']} "
            f"prompt tokens found in prefix caches ({cached}, prefill saved); home moves: {moves}")


def format_pool(name: str, status: dict[str, Any]) -> str:
    q = status["queue"]
    desired = status["desired"]
    lines = [
        f"pool {name}",
        f"desired: {'paused' if desired['paused'] else 'running'}, weights v{desired['weight_version']}"
        + (f" from {desired['weight_path']}" if desired["weight_path"] else "")
        + f" (generation {desired['generation']})",
        f"queue {q['name']}: {q['queued']} queued, {q['retrying']} waiting to retry, {q['started']} running, "
        f"{q['failed']} failed",
        f"agent turns: {status['turns']['lane_queued']} job(s) waiting in the shared lane {status['turns']['lane']} "
        f"({status['turns']['lane_taken']} running); workers' turn queues: {status['turns']['routed']} waiting, "
        f"{status['turns']['taken']} running",
    ]
    sessions = status["sessions"]
    if sessions["open"] or any(r.get("agent_turns") for r in status["runs"].values()):
        lines.append(format_sessions(sessions))
    if status.get("affinity"):
        lines.append(format_affinity(status["affinity"]))
    workers = status["workers"]
    lines.append(f"workers: {len(workers)} live")
    for w in workers:
        caps = w["capabilities"]
        lines.append(
            f"  {w['worker_id']}  {w['state']:<9} engine={w['engine']} weights=v{w['weight_version']}"
            f" job={w['current_job'] or '-'} heartbeat={w['heartbeat_age_s']}s ago"
            f" top_logprobs<={caps['max_top_logprobs']} routed_experts={caps['routed_experts']}"
            + (f" error={w['error']}" if w.get("error") else "")
        )
    for c in status["capability_classes"]:
        lines.append(f"  {c['workers']} worker(s) serve: {c['serves']}")
    if status["unservable"]:
        lines.append(f"waiting for a capability no live worker has: {len(status['unservable'])} job(s)")
        lines += [f"  {job_id}: {w.get('reason')}" for job_id, w in sorted(status["unservable"].items())]
    agents = status.get("agent_workers") or []
    if agents or any(r.get("episodes") for r in status["runs"].values()):
        lines.append(f"agent workers: {len(agents)} live")
        lines += [f"  {a['worker_id']}  {a['running']}/{a['concurrency']} episodes running, {a['finished']} finished, "
                  f"{a['failed']} failed  agents={','.join(a['agents'])} serve={a['serve']}" for a in agents]
    lines.append(f"runs: {len(status['runs'])}")
    for run, r in status["runs"].items():
        lines.append(
            f"  {run}: {r['shards']} shards, {r['rows']} rows, {r['tokens']} completion tokens, "
            f"weights {r['weight_versions']}"
            + (f", {r['canceled']} job(s) canceled" if r.get("canceled") else "")
            + (f", {r['agent_turns']['turns']} agent turns, {r['agent_turns']['prefix_breaks']} prefix breaks"
               if r.get("agent_turns") else "")
            + (f"; rewards: {r['rewards']['scored']}/{r['shards']} shards scored, {r['rewards']['failed']} failed"
               + (f", mean {r['rewards']['mean']:.4g}" if r["rewards"]["mean"] is not None else "")
               + (f", {r['rewards']['zero_variance']:.0%} of groups all-equal"
                  if r["rewards"]["zero_variance"] is not None else "")
               if r.get("rewards") else "")
            + (f", staleness {r['staleness']} (oldest token v{min(r['weight_versions'])} vs pushed "
               f"v{desired['weight_version']})" if r.get("staleness") is not None else "")
        )
        e = r.get("episodes")
        if e:
            lines.append(f"    episodes ({e['tasks']} tasks x {e['n']}, agent {e['agent']}): {e['queued']} queued, "
                         f"{e['running']} running, {e['finished']} finished, {e['failed']} failed"
                         + (f", {e['canceled']} canceled" if e["canceled"] else "") + f"; {e['retried']} "
                         f"retried, {e['abandoned']} abandoned by a worker that died, {e['handed_back']} handed "
                         "back by a worker shutting down"
                         + (f", {e['duplicates']} duplicate runs discarded" if e["duplicates"] else ""))
            lines += [f"      failed x{count}: {reason}" for reason, count in e["failure_reasons"].items()]
    if desired.get("error"):
        lines.insert(2, f"  REFUSED: {desired['error']}")
    if status["failed_jobs"]:
        lines.append("failed jobs: " + ", ".join(status["failed_jobs"]))
        reasons = status.get("failure_reasons", {})
        lines += [f"  {job_id}: {reasons[job_id]}" for job_id in status["failed_jobs"] if job_id in reasons]
    return "\n".join(lines)

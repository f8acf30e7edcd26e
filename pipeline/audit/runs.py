"""`pipeline runs`: the runs this Redis knows, newest first, with their jobs, rows and where they are."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from pipeline.core.broker import commit_log, keys, registry
from pipeline.core.jobs import episodes
from pipeline.core.jobs.forget import run_batches


@dataclass(frozen=True)
class RunSummary:
    """One run: its pools, when it was last submitted to, its jobs (and how many committed), its rows."""

    run: str
    pools: list[str]
    submitted_at: float | None  # seconds since the epoch of its latest submit (None: no batch record left)
    jobs: int
    committed_jobs: int
    rows: int
    tokens: int
    outputs: list[str]  # where its shards are: its batches' output and its agent turns' (`pipeline serve`)
    shards: int = 0  # committed, one per job or flushed turn shard (as `pipeline status` counts them)
    turns: int = 0  # agent turns committed (`pipeline serve`)
    episodes: tuple[int, int] | None = None  # agent episodes (ended, submitted), for a run of episodes


def list_runs(conn: redis.Redis, pool: str | None = None) -> list[RunSummary]:
    """Every run (or those submitted to `pool`), the most recently submitted first."""
    pools = [keys.pool_name(pool)] if pool else registry.pools(conn)
    where: dict[str, list[str]] = {}
    for name in pools:
        for run in conn.smembers(keys.pool(name).runs):
            where.setdefault(run.decode(errors="replace"), []).append(name)
    summaries = []
    for run, in_pools in where.items():
        batches = run_batches(conn, run).values()
        stamps = [int(b["submitted_at_ms"]) / 1000 for b in batches if b.get("submitted_at_ms")]
        totals = commit_log.totals(conn, run)
        info = episodes.run_info(conn, run)
        turns_output = conn.get(keys.turn_log_output(run))
        ended = None if info is None else (sum(info["counts"][s] for s in episodes.ENDED), info["counts"]["submitted"])
        if info is not None:
            stamps.append(int(info["submitted_at_ms"]) / 1000)
        summaries.append(RunSummary(
            run=run, pools=sorted(in_pools), submitted_at=max(stamps) if stamps else None,
            jobs=sum(len([j for j in b.get("job_ids", "").split(",") if j]) for b in batches),
            committed_jobs=conn.hlen(keys.run_jobs(run)), rows=totals.rows, tokens=totals.tokens,
            outputs=sorted({f"{b['output']}/{run}" for b in batches if b.get("output")}
                           | ({f"{turns_output.decode()}/{run}"} if turns_output else set())),
            shards=totals.shards,
            turns=int(conn.hget(keys.run_turn_stats(run), "turns") or 0), episodes=ended,
        ))
    return sorted(summaries, key=lambda s: (-(s.submitted_at or 0), s.run))


def _work(run: RunSummary) -> str:
    """What a run is made of: batch jobs committed/submitted, agent episodes ended/submitted, agent turns."""
    parts = [f"{run.committed_jobs - run.turns}/{run.jobs}"] if run.jobs else []
    if run.episodes is not None:
        parts.append(f"{run.episodes[0]}/{run.episodes[1]} episodes")
    if run.turns:
        parts.append(f"{run.turns} agent turns")
    return ", ".join(parts) or "0/0"


def format_runs(runs: list[RunSummary]) -> str:
    """A table: run, pool, submitted (local time), batch jobs committed/submitted (and agent episodes
    ended/submitted, agent turns), rows, tokens, shards committed, where they are."""
    if not runs:
        return "no runs in this Redis (`pipeline submit FILE --run NAME` makes one)"
    header = ("run", "pool", "submitted", "jobs", "rows", "tokens", "shards", "where")
    lines = [header] + [
        (r.run, ",".join(r.pools),
         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted_at)) if r.submitted_at else "-",
         _work(r), str(r.rows), str(r.tokens), str(r.shards), " ".join(r.outputs) or "-")
        for r in runs
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1]
                     for line in lines).rstrip()

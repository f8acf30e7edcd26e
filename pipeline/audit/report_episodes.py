"""The episodes section of `pipeline report` (a run of agent episodes, `pipeline submit --agent`):
how many finished, failed, were retried or abandoned; the reward by the number of turns an
episode took; how long episodes took; why they failed. Read from the run's committed outcomes
(`pipeline.core.jobs.episodes`), so it holds whether or not the turns are in shards yet."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

import redis

from pipeline.audit.report_html import html_section, html_table, new_figure, png
from pipeline.core.jobs import episodes

REASONS_SHOWN = 10


def episodes_section(conn: redis.Redis, run: str) -> str | None:
    """The section, None for a run without episodes."""
    info = episodes.run_info(conn, run)
    if info is None:
        return None
    outcomes = list(episodes.outcomes(conn, run).values())
    counts = info["counts"]
    overview = html_table(
        ["episodes", "finished", "failed", "canceled", "queued", "running", "retried", "abandoned", "handed back",
         "duplicates"],
        [[counts["submitted"], counts["finished"], counts["failed"], counts["canceled"], counts["queued"],
          counts["running"],
          counts["retried"], counts["abandoned"], counts["handed_back"], counts["duplicates"]]])
    by_turns: dict[int, list[float]] = defaultdict(list)
    for outcome in outcomes:
        if outcome.status == "finished" and outcome.reward is not None:
            by_turns[outcome.turns].append(outcome.reward)
    turns_rows = [[turns, len(rewards), statistics.fmean(rewards)] for turns, rewards in sorted(by_turns.items())]
    seconds = sorted((o.finished_at_ms - o.started_at_ms) / 1000 for o in outcomes if o.status != "canceled")
    durations = html_table(["episodes", "p50 s", "p90 s", "max s", "attempts > 1"], [[
        len(seconds), seconds[len(seconds) // 2] if seconds else float("nan"),
        seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))] if seconds else float("nan"),
        seconds[-1] if seconds else float("nan"), sum(1 for o in outcomes if o.attempts > 1)]])
    reasons = Counter(o.reason for o in outcomes if o.status == "failed")
    failures = html_table(["failed", "reason"], [[n, reason] for reason, n in reasons.most_common(REASONS_SHOWN)]) \
        if reasons else ""
    image = None
    if turns_rows:
        fig, ax = new_figure()
        ax.bar([str(r[0]) for r in turns_rows], [r[2] for r in turns_rows])
        ax.set_xlabel("turns in the episode")
        ax.set_ylabel("mean reward")
        image = png(fig)
    table = (overview + html_table(["turns", "finished episodes", "mean reward"], turns_rows) + durations
             + failures)
    note = (f"agent {info['agent']}, {len(info['tasks'])} tasks x {info['n']}; failed episodes are left out of "
            "training" + ("" if info.get("failed_reward") is None else f" unless given reward {info['failed_reward']}")
            + "; retried and abandoned attempts' sessions never reach training")
    return html_section("Agent episodes", image, table, note=note)


"""The episodes section of `pipeline report` (a run of agent episodes, `pipeline submit --agent`):
how many finished, failed, were canceled, retried, abandoned or handed back, and how many reach
training (what every trajectory reader returns, by `pipeline.core.jobs.episodes.trained`); the reward
distribution and the reward over the run (episodes in the order they ended); the reward by the number
of turns an episode took; how long episodes took; why they failed. Read from the run's committed
outcomes (`pipeline.core.jobs.episodes`), so it holds whether or not the turns are in shards yet."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict

import redis

from pipeline.audit.report_html import html_section, html_table, new_figure, png
from pipeline.core.jobs import episodes

REASONS_SHOWN = 10
DISTINCT_SHOWN = 12  # a table of rewards and their counts when there are at most this many values


def _bins(rewards: list[float]) -> int | list[float]:
    """One bar per value for a few distinct rewards (0/1, a rubric's levels), else 20 even bins."""
    values = sorted(set(rewards))
    if len(values) > DISTINCT_SHOWN:
        return 20
    if len(values) == 1:
        return [values[0] - 0.5, values[0] + 0.5]
    step = min(b - a for a, b in itertools.pairwise(values))
    return [v - step / 2 for v in values] + [values[-1] + step / 2]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each `window` consecutive values (len(values) - window + 1 of them)."""
    total, means = sum(values[:window]), []
    means.append(total / window)
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        means.append(total / window)
    return means


def episodes_section(conn: redis.Redis, run: str) -> str | None:
    """The section, None for a run without episodes."""
    info = episodes.run_info(conn, run)
    if info is None:
        return None
    outcomes = list(episodes.outcomes(conn, run).values())
    trained = episodes.trained(outcomes, info.get("failed_reward"))
    counts = info["counts"]
    overview = html_table(
        ["episodes", "in training", "finished", "failed", "canceled", "queued", "running", "retried", "abandoned",
         "handed back", "duplicates"],
        [[counts["submitted"], len(trained), counts["finished"], counts["failed"], counts["canceled"],
          counts["queued"], counts["running"], counts["retried"], counts["abandoned"], counts["handed_back"],
          counts["duplicates"]]])
    by_turns: dict[int, list[float]] = defaultdict(list)
    for outcome in trained:
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
    finished = sorted((o for o in trained if o.status == "finished" and o.reward is not None),
                      key=lambda o: o.finished_at_ms)
    image, distribution, over_run = None, "", ""
    if finished:
        rewards = [float(o.reward) for o in finished]  # type: ignore[arg-type]
        fig, (left, right) = new_figure(2)
        left.hist(rewards, bins=_bins(rewards))
        left.set_xlabel("reward")
        left.set_ylabel("finished episodes")
        left.set_title("reward distribution")
        window = max(1, len(rewards) // 10)
        right.plot(range(1, len(rewards) + 1), rewards, ".", alpha=0.4, label="episode")
        right.plot(range(window, len(rewards) + 1), _rolling_mean(rewards, window), label=f"mean of {window}")
        right.set_xlabel("finished episodes, in the order they ended")
        right.set_ylabel("reward")
        right.set_title("reward over the run")
        right.legend(loc="best", fontsize="small")
        image = png(fig)
        if len(set(rewards)) <= DISTINCT_SHOWN:
            distribution = html_table(["reward", "finished episodes"], sorted(map(list, Counter(rewards).items())))
        tenths = [rewards[len(rewards) * i // 10:len(rewards) * (i + 1) // 10] for i in range(10)]
        over_run = html_table(["ended (tenth of the run)", "finished episodes", "mean reward"],
                              [[i + 1, len(part), statistics.fmean(part)] for i, part in enumerate(tenths) if part])
    table = (overview + distribution + over_run + html_table(["turns", "finished episodes", "mean reward"], turns_rows)
             + durations + failures)
    note = (f"agent {info['agent']}, {len(info['tasks'])} tasks x {info['n']}; in training: the episodes every "
            "trajectory reader returns; failed episodes are left out"
            + ("" if info.get("failed_reward") is None else f" unless given reward {info['failed_reward']}")
            + ", and so is every episode of a task with a canceled one; retried, abandoned, handed-back, duplicate "
            "and canceled attempts' sessions never reach training. Left: the finished episodes' rewards; right: "
            "each one's reward in the order they ended, and a running mean")
    return html_section("Agent episodes", image, table, note=note)


"""`pipeline report`: one self-contained HTML page of a run (plots embedded, nothing fetched).

Sections, each a plot (PNG, base64 in the page) beside a table of its numbers:

- rewards, when rows have them (a batch submitted with a reward function): mean reward per step
  (a submitted batch, in submit order) and per weight version (`pipeline.audit.report_rewards`);
- completion lengths per weight version (histogram; rows, mean and percentiles);
- finish and stop reasons (counts per version);
- logprobs of the sampled tokens, and the entropy proxy: a row's mean −logprob of its sampled
  tokens (a Monte-Carlo estimate of the policy's per-token entropy);
- rows and tokens per worker (and engine);
- throughput: completion tokens per second, from each row's `started_at` and `finished_at` (the
  time its job held a worker): over the span from the first start to the last finish, and over
  the time some job was generating (idle gaps, e.g. a trainer's step between batches, left out);
- staleness, when rows continued across partial swaps: per token, how many versions it lags
  the newest version of its row;
- agent sessions, when the run has agent turns (`pipeline serve`): turns, sessions and prefix
  breaks in the shards, beside the run's counts in Redis (`keys.run_turn_stats`) when read by run;
- the `pipeline verify` summary when one was run (`verify=` / `--verify-model`).

Rows are read a record batch at a time into fixed-bin histograms and counters, so memory
follows a batch, not the run. matplotlib (the `report` extra) draws the plots; `import
pipeline` does not import it.
"""

from __future__ import annotations

import html
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import redis

from pipeline.audit.report_episodes import episodes_section
from pipeline.audit.report_html import html_section, html_table, new_figure, png
from pipeline.audit.report_rewards import RewardFigures, rewards_section, with_rewards, written_rewards
from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError
from pipeline.core.shards import is_location, rollouts_dataset
from pipeline.core.verify_stats import VerifyReport

COLUMNS = ["rollout_id", "job_id", "worker_id", "engine", "weight_version", "completion_tokens",
           "finish_reason", "stop_reason_text", "stop_reason_token", "completion_logprobs", "submitted_at",
           "started_at", "finished_at"]
# Columns a shard may lack (written before they existed): read as nulls.
OPTIONAL = ["weight_version_segments", "sample_index", "session_id", "prefix_break", "adapter", "adapter_version",
            "adapter_version_segments"]
LOGPROB_BINS = np.linspace(-20.0, 0.0, 81)
READ_BATCH_ROWS = 4096


@dataclass
class RunFigures:
    """What the page shows, gathered in one streaming pass over the shards."""

    rows: int = 0
    tokens: int = 0
    lengths: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    finishes: Counter = field(default_factory=Counter)  # (version, finish_reason, stop) -> rows
    logprob_hist: np.ndarray = field(default_factory=lambda: np.zeros(len(LOGPROB_BINS) + 1, np.int64))
    logprob_sum: float = 0.0
    logprob_count: int = 0
    entropy: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    workers: Counter = field(default_factory=Counter)  # (worker, engine) -> rows
    # (LoRA adapter, its version; None, None: the base weights) -> rows, tokens, rewards
    policies: Counter = field(default_factory=Counter)
    policy_tokens: Counter = field(default_factory=Counter)
    policy_continued: Counter = field(default_factory=Counter)  # rows continued on a newer adapter version
    policy_rewards: dict[tuple[str | None, int | None], list[float]] = field(default_factory=lambda: defaultdict(list))
    worker_tokens: Counter = field(default_factory=Counter)
    # job -> (its rows' first start, last finish, completion tokens)
    job_times: dict[str, tuple[datetime, datetime, int]] = field(default_factory=dict)
    lag_tokens: Counter = field(default_factory=Counter)  # versions behind the row's newest -> tokens
    continued_rows: int = 0
    agent_rows: int = 0  # rows of agent turns (`pipeline serve`): a turn's n samples are n rows
    agent_turns: int = 0
    prefix_breaks: int = 0  # turns rendered in full because the agent rewrote its history
    sessions: set[str] = field(default_factory=set)
    rewards: RewardFigures = field(default_factory=RewardFigures)

    def add(self, batch: pa.Table) -> None:
        for row in batch.to_pylist():
            self.rewards.add(row)
            version = int(row["weight_version"])
            n = int(row["completion_tokens"])
            self.rows += 1
            self.tokens += n
            self.lengths[version].append(n)
            stop = row["stop_reason_text"] if row["stop_reason_text"] is not None else row["stop_reason_token"]
            self.finishes[(version, row["finish_reason"], "" if stop is None else repr(stop))] += 1
            policy = (row["adapter"], row["adapter_version"])
            self.policies[policy] += 1
            adapter_segments = row["adapter_version_segments"]
            if adapter_segments:  # continued across a partial adapter push: tokens to each version
                self.policy_continued[policy] += 1
                ends = [int(s["start"]) for s in adapter_segments[1:]] + [n]
                for s, end in zip(adapter_segments, ends, strict=True):
                    self.policy_tokens[(row["adapter"], int(s["version"]))] += end - int(s["start"])
            else:
                self.policy_tokens[policy] += n
            if row["reward"] is not None:
                self.policy_rewards[policy].append(float(row["reward"]))
            key = (row["worker_id"], row["engine"])
            self.workers[key] += 1
            self.worker_tokens[key] += n
            started, finished, tokens = self.job_times.get(row["job_id"], (row["started_at"], row["finished_at"], 0))
            self.job_times[row["job_id"]] = (min(started, row["started_at"]), max(finished, row["finished_at"]),
                                              tokens + n)
            logprobs = row["completion_logprobs"]
            if logprobs:
                values = np.asarray(logprobs, dtype=np.float64)
                finite = values[np.isfinite(values)]
                bins = np.searchsorted(LOGPROB_BINS, finite)
                self.logprob_hist += np.bincount(bins, minlength=len(self.logprob_hist))
                self.logprob_sum += float(finite.sum())
                self.logprob_count += int(finite.size)
                if finite.size:
                    self.entropy[version].append(float(-finite.mean()))
            segments = row["weight_version_segments"]
            if segments:
                self.continued_rows += 1
                newest = max(int(s["version"]) for s in segments)
                ends = [int(s["start"]) for s in segments[1:]] + [n]
                for s, end in zip(segments, ends, strict=True):
                    self.lag_tokens[newest - int(s["version"])] += end - int(s["start"])
            elif n:
                self.lag_tokens[0] += n
            if row["session_id"] is not None:
                self.agent_rows += 1
                self.sessions.add(row["session_id"])
                if not row["sample_index"]:  # a turn counted once, at its first sample
                    self.agent_turns += 1
                    self.prefix_breaks += bool(row["prefix_break"])


def gather(dataset: pads.Dataset, rewarded_jobs: set[str] | None = None) -> RunFigures:
    """The figures of every row, a shard at a time (its rewards joined from the rewards shard beside
    it; `rewarded_jobs`: only those jobs' rewards, as the run's reward log records them)."""
    missing = [c for c in COLUMNS if c not in dataset.schema.names]
    if missing:
        raise PipelineError(f"the shards lack columns {missing}; they are not rollout shards of this pipeline")
    names = COLUMNS + [c for c in OPTIONAL if c in dataset.schema.names]
    filesystem = getattr(dataset, "filesystem", None)
    figures = RunFigures()
    for fragment in dataset.get_fragments():
        path = getattr(fragment, "path", None)
        for batch in fragment.to_batches(schema=dataset.schema, columns=names, batch_size=READ_BATCH_ROWS):
            for name in OPTIONAL:
                if name not in batch.schema.names:
                    batch = batch.append_column(name, pa.nulls(batch.num_rows))
            figures.add(with_rewards(batch, filesystem, path, rewarded_jobs))
    return figures


# -- drawing -------------------------------------------------------------------------------------

def _lengths_section(f: RunFigures) -> str:
    fig, ax = new_figure()
    every = [n for values in f.lengths.values() for n in values]
    bins = np.histogram_bin_edges(every or [0], bins=30)
    for version, values in sorted(f.lengths.items()):
        ax.hist(values, bins=bins, alpha=0.6, label=f"v{version}")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("rows")
    ax.legend()
    rows = [[f"v{v}", len(x), float(np.mean(x)), *(float(np.percentile(x, q)) for q in (50, 90, 99)), max(x)]
            for v, x in sorted(f.lengths.items())]
    return html_section("Completion length per weight version", png(fig),
                        html_table(["version", "rows", "mean", "p50", "p90", "p99", "max"], rows))


def _finish_section(f: RunFigures) -> str:
    fig, ax = new_figure()
    by_reason = Counter()
    for (_, reason, stop), count in f.finishes.items():
        by_reason[f"{reason} {stop}".strip()] += count
    labels = sorted(by_reason, key=lambda k: -by_reason[k])
    ax.barh(labels, [by_reason[k] for k in labels])
    ax.set_xlabel("rows")
    rows = [[f"v{v}", reason, stop or "—", count, count / f.rows]
            for (v, reason, stop), count in sorted(f.finishes.items(), key=lambda kv: (kv[0][0], -kv[1]))]
    return html_section("Finish and stop reasons", png(fig),
                        html_table(["version", "finish_reason", "stop", "rows", "share"], rows),
                        note="stop: the user's stop string or token that matched (none: the model's own end token)")


def _logprob_section(f: RunFigures) -> str:
    if not f.logprob_count:
        return html_section("Logprobs and entropy proxy", None, "<p>no row stores logprobs</p>")
    fig, (left, right) = new_figure(columns=2)
    centers = np.concatenate([[LOGPROB_BINS[0] - 0.125], (LOGPROB_BINS[:-1] + LOGPROB_BINS[1:]) / 2, [0.0]])
    left.bar(centers, f.logprob_hist, width=0.25)
    left.set_xlabel("logprob of the sampled token (≤ −20 at the left edge)")
    left.set_ylabel("tokens")
    for version, values in sorted(f.entropy.items()):
        right.hist(values, bins=30, alpha=0.6, label=f"v{version}")
    right.set_xlabel("row mean −logprob (entropy proxy)")
    right.legend()
    rows = [[f"v{v}", len(x), float(np.mean(x)), float(np.percentile(x, 10)), float(np.percentile(x, 90))]
            for v, x in sorted(f.entropy.items())]
    table = html_table(["version", "rows", "mean entropy proxy", "p10", "p90"], rows)
    table += html_table(["tokens with logprobs", "mean logprob"], [[f.logprob_count, f.logprob_sum / f.logprob_count]])
    return html_section("Logprobs and entropy proxy", png(fig), table)


def _workers_section(f: RunFigures) -> str:
    fig, ax = new_figure()
    keys = sorted(f.workers, key=lambda k: -f.worker_tokens[k])
    ax.barh([f"{w} ({e})" for w, e in keys], [f.worker_tokens[k] for k in keys])
    ax.set_xlabel("completion tokens")
    rows = [[w, e, f.workers[(w, e)], f.worker_tokens[(w, e)]] for w, e in keys]
    return html_section("Rows and tokens per worker", png(fig),
                        html_table(["worker", "engine", "rows", "tokens"], rows))


def _adapters_section(f: RunFigures) -> str | None:
    """Rows, tokens and mean reward per LoRA adapter version and the base; None when no row ran on one."""
    if all(name is None for name, _ in f.policies):
        return None
    keys = sorted(set(f.policies) | set(f.policy_tokens), key=lambda k: (k[0] is not None, k[0] or "", k[1] or 0))
    rows = [["base" if name is None else name, "—" if version is None else f"v{version}", f.policies[(name, version)],
             f.policy_continued[(name, version)], f.policy_tokens[(name, version)],
             f"{np.mean(f.policy_rewards[(name, version)]):.4g}" if f.policy_rewards[(name, version)] else "—"]
            for name, version in keys]
    table = html_table(["adapter", "version", "rows", "continued", "tokens", "mean reward"], rows)
    return html_section("LoRA adapters", None, table,
                        note="each row's adapter and adapter version, the oldest of its tokens (docs/adapters.md); "
                             "continued: rows a partial adapter push moved on to a newer version mid-sample; "
                             "tokens: those each version generated; base: no adapter")


def _generating_s(intervals: np.ndarray) -> float:
    """Seconds covered by at least one of the (start, end) intervals (their union's length)."""
    total, reach = 0.0, -math.inf
    for begin, end in intervals[np.argsort(intervals[:, 0])]:
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def _throughput_section(f: RunFigures) -> str:
    if not f.job_times:
        return html_section("Throughput", None, "<p>nothing committed</p>")
    intervals = np.array([(a.timestamp(), b.timestamp()) for a, b, _ in f.job_times.values()])
    tokens = np.array([t for _, _, t in f.job_times.values()], dtype=np.float64)
    start, end = float(intervals[:, 0].min()), float(intervals[:, 1].max())
    span, generating = end - start, _generating_s(intervals)
    note = ("from each row's started_at and finished_at (the time its job held a worker, from taking it to "
            "building its rows): the span runs from the first start to the last finish; 'while generating' "
            "counts only the time some job was running (idle gaps between jobs left out)")
    total = float(tokens.sum())
    # A rate needs time to divide by: "—" where rows started and finished within the same millisecond.
    rates: list[Any] = [total / span if span > 0 else "—", total / generating if generating > 0 else "—"]
    if generating <= 0:
        note += ("; every job's rows started and finished within the same millisecond: too short to measure a "
                 "rate while generating, so none is shown")
    image = None
    if span > 0:
        # Each job's tokens spread evenly over its own time (a job of no duration: all in its bin).
        edges = np.linspace(0.0, span, min(30, max(2, len(tokens))) + 1)
        per_bin = np.zeros(len(edges) - 1)
        for (begin, finish), count in zip(intervals - start, tokens, strict=True):
            if finish > begin:
                overlap = np.clip(np.minimum(edges[1:], finish) - np.maximum(edges[:-1], begin), 0.0, None)
                per_bin += count * overlap / (finish - begin)
            else:
                per_bin[min(int(np.searchsorted(edges, begin, side="right")) - 1, len(per_bin) - 1)] += count
        fig, ax = new_figure()
        ax.step(edges[:-1], per_bin / (edges[1] - edges[0]), where="post")
        ax.set_xlabel("seconds since the first row started")
        ax.set_ylabel("completion tokens / s")
        image = png(fig)
    rows = [[datetime.fromtimestamp(start, UTC).isoformat(timespec="seconds"),
             datetime.fromtimestamp(end, UTC).isoformat(timespec="seconds"), f"{span:.1f}", f"{generating:.1f}",
             len(tokens), int(total), *rates]]
    return html_section("Throughput over time", image,
                        html_table(["first start (UTC)", "last finish (UTC)", "span (s)", "generating (s)", "jobs",
                                    "completion tokens", "tokens/s over the span", "tokens/s while generating"], rows),
                        note=note)


def _staleness_section(f: RunFigures) -> str:
    if not f.continued_rows:
        return html_section("Staleness", None, "<p>no row was continued across a partial weight swap: every token "
                            "of a row comes from one weight version</p>")
    fig, ax = new_figure()
    lags = sorted(f.lag_tokens)
    ax.bar([str(lag) for lag in lags], [f.lag_tokens[lag] for lag in lags])
    ax.set_xlabel("versions behind the row's newest")
    ax.set_ylabel("tokens")
    total = sum(f.lag_tokens.values())
    rows = [[lag, f.lag_tokens[lag], f.lag_tokens[lag] / total] for lag in lags]
    return html_section("Staleness (weight-version lag)", png(fig), html_table(["lag", "tokens", "share"], rows),
                        note=f"{f.continued_rows} rows continued across partial swaps")


def _agent_section(f: RunFigures, stats: dict[str, int] | None) -> str:
    """Agent turns in the shards and, read by run, the run's counts in Redis: prefix breaks counted, never silent."""
    rows: list[list[Any]] = [["shards", f.agent_turns, f.prefix_breaks, len(f.sessions), f.agent_rows]]
    notes = ["prefix break: the agent rewrote its history, so the turn was rendered in full instead of "
             "continuing the previous turn's token ids"]
    if stats is not None:
        rows.append(["Redis (the run's turn counts)", stats["turns"], stats["prefix_breaks"], "—", "—"])
        if stats["unflushed"]:
            notes.append(f"{stats['unflushed']} turn(s) are in the run's turn log, not yet in a shard")
        apart = stats["turns"] - f.agent_turns - stats["unflushed"]
        if apart:
            notes.append(f"Redis counts {apart:+d} turn(s) against the shards and the turn log (turns logged by a "
                         "worker but never recorded by their server, or shards not in the commit log)")
    return html_section("Agent sessions", None,
                        html_table(["from", "agent turns", "prefix breaks", "sessions", "rows"], rows),
                        note="; ".join(notes))


def _verify_section(report: VerifyReport) -> str:
    summary = report.table.to_pylist()
    fig, ax = new_figure()
    labels = [f"v{r['weight_version']} {r['engine']}" for r in summary]
    ax.bar(labels, [r["mean_abs_diff"] for r in summary], label="mean |Δ|")
    ax.bar(labels, [r["max_abs_diff"] for r in summary], alpha=0.4, label="max |Δ|")
    ax.set_yscale("log")
    ax.set_ylabel("|Δ logprob|")
    ax.legend()
    names = ["weight_version", "engine", "tokens", "mean_abs_diff", "p99_abs_diff", "max_abs_diff", "k1", "k3",
             "ratio_mean", "ratio_p99", "share_above"]
    table = html_table(names, [[r[n] for n in names] for r in summary])
    if report.experts.num_rows:
        table += html_table(["version", "layer", "positions", "share equal"],
                            [[e["weight_version"], e["layer"], e["positions"], e["share"]]
                             for e in report.experts.to_pylist()])
    return html_section("Verify: stored vs recomputed logprobs", png(fig), table,
                        note=f"share_above: |Δ| > {report.threshold:g}")


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}h1{font-size:1.5em}
section{margin:2em 0}.pair{display:flex;gap:2em;align-items:flex-start;flex-wrap:wrap}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}.note{color:#666;font-size:.85em}img{max-width:640px}"""


def render(source: str, figures: RunFigures, *, verify: VerifyReport | None = None,
           turn_stats: dict[str, int] | None = None, episodes: str | None = None) -> str:
    """The page as one HTML string (`turn_stats`: the run's agent-turn counts in Redis, see `_turn_stats`)."""
    if not figures.rows:
        raise PipelineError(f"no rows under {source!r}: nothing to report")
    overview = html_table(["rows", "completion tokens", "weight versions", "workers", "jobs"], [[
        figures.rows, figures.tokens, ", ".join(f"v{v}" for v in sorted(figures.lengths)), len(figures.workers),
        len(figures.job_times)]])
    sections = [
        _lengths_section(figures), _finish_section(figures), _logprob_section(figures), _workers_section(figures),
        _throughput_section(figures), _staleness_section(figures),
    ]
    adapters = _adapters_section(figures)
    if adapters is not None:
        sections.insert(0, adapters)
    rewards = rewards_section(figures.rewards)
    if rewards is not None:
        sections.insert(0, rewards)
    if figures.agent_rows or turn_stats is not None:
        sections.insert(0, _agent_section(figures, turn_stats))
    if episodes is not None:
        sections.insert(0, episodes)
    if verify is not None:
        sections.append(_verify_section(verify))
    title = f"Rollout report: {source}"
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{overview}{''.join(sections)}"
            "</body></html>")


def _turn_stats(conn: redis.Redis, run: str) -> dict[str, int] | None:
    """The run's agent turns and prefix breaks as `pipeline serve` counted them, and the turns not
    yet flushed from its turn log to a shard; None when the run has no agent turn."""
    stats = conn.hgetall(keys.run_turn_stats(run))
    unflushed = conn.xlen(keys.turn_log(run))
    if not stats and not unflushed:
        return None
    return {"turns": int(stats.get(b"turns", 0)), "prefix_breaks": int(stats.get(b"prefix_breaks", 0)),
            "unflushed": unflushed}


def report(source: str, *, conn: redis.Redis | None = None, verify_model: Any = None,
           verify_options: dict[str, Any] | None = None) -> str:
    """The HTML page of `source` (a URL or directory of shards; a run name with `conn`). With
    `verify_model`, `pipeline.verify` runs first (`verify_options` passed on) and its summary is a
    section of the page."""
    turn_stats, rewarded_jobs, episodes = None, None, None
    if is_location(source):
        dataset = rollouts_dataset(source)
    elif conn is not None:
        dataset = rollouts_dataset([], source, conn=conn)
        turn_stats, rewarded_jobs = _turn_stats(conn, source), written_rewards(conn, source)
        episodes = episodes_section(conn, source)
    else:
        raise PipelineError(f"{source!r} is neither a URL nor an existing path; a run name needs a Redis connection")
    figures = gather(dataset, rewarded_jobs)
    checked = None
    if verify_model is not None:
        from pipeline.audit.verify import verify

        checked = verify(source, verify_model, conn=conn, **(verify_options or {}))
    return render(source, figures, verify=checked, turn_stats=turn_stats, episodes=episodes)


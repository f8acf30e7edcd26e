"""`GET /metrics` of `pipeline serve`: the pool's agent-turn figures in Prometheus' text format.

The same numbers as `pipeline status` (`pipeline.audit.status.affinity`), read from Redis at
each scrape, so every server of a pool reports the pool's figures (scrape one of them):
sessions open, turns committed and per second, turns of sessions with a home and those served
there, prompt tokens and those found in the engines' prefix caches, home moves by reason.
"""

from __future__ import annotations

import redis

from pipeline.audit.status import affinity
from pipeline.core.broker import keys

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _sample(name: str, kind: str, help_text: str, value: float, labels: dict[str, str] | None = None) -> list[str]:
    label = "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {value:g}"]


def render(conn: redis.Redis, pool: str) -> str:
    """The exposition text for `pool`."""
    where = keys.pool(pool)
    labels = {"pool": where.name}
    lines = _sample("pipeline_sessions_open", "gauge", "Agent sessions open in the pool.",
                    conn.scard(where.open_sessions), labels)
    figures = affinity(conn, where.name) or {"turns": 0, "turns_per_s": 0.0, "homed_turns": 0, "home_turns": 0,
                                             "prompt_tokens": 0, "cached_tokens": 0, "moves": {}}
    for name, kind, help_text, key in (
        ("pipeline_agent_turns_total", "counter", "Agent turns committed.", "turns"),
        ("pipeline_agent_turns_per_second", "gauge", "Agent turns committed per second over the last minute.",
         "turns_per_s"),
        ("pipeline_agent_homed_turns_total", "counter", "Turns of sessions that had a home worker.", "homed_turns"),
        ("pipeline_agent_home_turns_total", "counter", "Of those, turns served on the session's home worker.",
         "home_turns"),
        ("pipeline_agent_prompt_tokens_total", "counter", "Prompt tokens of agent turns.", "prompt_tokens"),
        ("pipeline_agent_cached_tokens_total", "counter",
         "Prompt tokens the engines found in their prefix caches (prefill saved).", "cached_tokens"),
    ):
        lines += _sample(name, kind, help_text, figures[key], labels)
    lines += ["# HELP pipeline_agent_home_moves_total Session homes moved to another worker, by reason.",
              "# TYPE pipeline_agent_home_moves_total counter"]
    for reason, count in sorted(figures["moves"].items()):
        lines.append(f'pipeline_agent_home_moves_total{{pool="{where.name}",reason="{reason}"}} {count}')
    return "\n".join(lines) + "\n"

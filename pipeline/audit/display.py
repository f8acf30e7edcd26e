"""Rendering shard rows for people: `pipeline show`."""

from __future__ import annotations

import json

import pyarrow as pa


def token_ids_text(ids: list[int]) -> str:
    """Tokens as `token_id:<id>`: display only, never an input form."""
    return " ".join(f"token_id:{i}" for i in ids)


def _shorten(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_rows(table: pa.Table, *, token_ids: bool = False, width: int = 160) -> str:
    lines: list[str] = []
    for row in table.to_pylist():
        stop = row.get("stop_reason_text")
        if stop is None:
            stop = row.get("stop_reason_token")
        logprobs = row.get("completion_logprobs") or []
        mean = sum(logprobs) / len(logprobs) if logprobs else float("nan")
        lines.append(
            f"{row['rollout_id']}  finish={row['finish_reason']}"
            + (f" stop={stop!r}" if stop is not None else "")
            + f"  prompt={row['prompt_tokens']} completion={row['completion_tokens']}"
            f"  weights=v{row['weight_version']}  mean_logprob={mean:.3f}"
        )
        if token_ids or row.get("completion_text") is None:
            body = token_ids_text(row["completion_token_ids"])
        else:
            body = row["completion_text"]
        lines.append("    " + _shorten(body, width))
    return "\n".join(lines)


def rows_as_json(table: pa.Table, *, token_ids: bool = False) -> str:
    out = []
    for row in table.to_pylist():
        for key in ("submitted_at", "started_at", "finished_at"):
            row[key] = row[key].isoformat() if row.get(key) else None
        if token_ids:
            row["completion_tokens_display"] = token_ids_text(row["completion_token_ids"])
        out.append(json.dumps(row, ensure_ascii=False))
    return "\n".join(out)

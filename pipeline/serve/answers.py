"""A turn's rows as OpenAI answers: chat completions (whole or as SSE chunks) and text completions.

Each choice is one row (one sample). Its completion text is parsed the way SGLang's OpenAI
server parses it (`pipeline.serve.parsers`): reasoning first, then tool calls in what is left,
content never dropped; `finish_reason` is "tool_calls" when calls were parsed. Tool call ids are
derived from the turn's id, so an answer given again (a retried call) is the same answer.

Beside OpenAI's fields every answer says where it came from, for trainers and agent logs:
`session_id`, `turn`, and per choice `rollout_id`, `weight_version` and the completion's
`token_ids`; clients that do not know them ignore them.

Streamed calls get their tokens as they are generated and the rest of this answer at the end
(`pipeline.serve.live`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.serve.parsers import parse_chat_answer

TokenText = Any  # a callable: token id -> its text


@dataclass(frozen=True)
class ParseRules:
    """How completions become chat answers: the server's parsers and the request's tools."""

    reasoning_parser: str | None
    tool_call_parser: str | None
    tools: list[dict[str, Any]] | None
    tool_choice_none: bool
    chat_template_kwargs: dict[str, Any] | None


def _call_id(turn_id: str, choice: int, index: int) -> str:
    return "call_" + hashlib.sha256(f"{turn_id}:{choice}:{index}".encode()).hexdigest()[:24]


# What answers and session records read of a turn's rows; the rest of a row is the shard's. The prompt
# ids come beside them, as an array (`turn_rows`).
ANSWER_COLUMNS = ("sample_index", "rollout_id", "worker_id", "prompt_text", "prompt_tokens",
                  "cached_tokens", "completion_token_ids", "completion_logprobs", "completion_top_logprobs",
                  "completion_text", "completion_tokens", "finish_reason", "stop_reason_text", "stop_reason_token",
                  "weight_version", "weight_version_segments", "prefix_break", "parent_turn", "parent_sample")


def turn_rows(table: pa.Table) -> list[dict[str, Any]]:
    """A turn's rows as dicts of `ANSWER_COLUMNS` and their `prompt_token_ids` (an int32 array each, a
    view of the table's: a long prompt's ids never become Python ints), by sample index (pyarrow
    makes Python objects column by column: the columns nobody reads here cost as much as the long
    prompt)."""
    rows = table.select(ANSWER_COLUMNS).to_pylist()
    prompts = table.column("prompt_token_ids").combine_chunks()
    ids, offsets = prompts.values.to_numpy(), prompts.offsets.to_numpy()
    for row, start, end in zip(rows, offsets[:-1], offsets[1:], strict=True):
        row["prompt_token_ids"] = ids[start:end]
    return sorted(rows, key=lambda r: r["sample_index"])


def usage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = rows[0]["prompt_tokens"] if rows else 0
    completion = sum(r["completion_tokens"] for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": rows[0]["cached_tokens"] if rows else 0}}


def _chat_logprobs(row: dict[str, Any], token_text: TokenText) -> dict[str, Any]:
    tops = row["completion_top_logprobs"]
    content = []
    for position, (token_id, logprob) in enumerate(zip(row["completion_token_ids"], row["completion_logprobs"],
                                                       strict=True)):
        text = token_text(token_id)
        entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        if tops is not None:
            entry["top_logprobs"] = [
                {"token": (t := token_text(alt["token_id"])), "logprob": alt["logprob"], "bytes": list(t.encode())}
                for alt in tops[position]
            ]
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_answer(rows: list[dict[str, Any]], *, turn_id: str, model: str, session_id: str, turn: int, rules: ParseRules,
                text_of: Any, token_text: TokenText, logprobs: bool) -> dict[str, Any]:
    """The `chat.completion` object for a turn's rows (`turn_rows`). `text_of(row)` is the completion text to parse."""
    choices = []
    for row in rows:
        finish = row["finish_reason"]
        parsed = parse_chat_answer(
            text_of(row),
            reasoning_parser=rules.reasoning_parser,
            tool_call_parser=None if rules.tool_choice_none or not rules.tools else rules.tool_call_parser,
            tools=rules.tools, chat_template_kwargs=rules.chat_template_kwargs, finish_reason=finish,
        )
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": _call_id(turn_id, row["sample_index"], k), "index": k, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for k, call in enumerate(parsed.tool_calls)
            ]
        choices.append({
            "index": row["sample_index"], "message": message,
            "logprobs": _chat_logprobs(row, token_text) if logprobs else None,
            "finish_reason": parsed.finish_reason,
            "matched_stop": row["stop_reason_token"] if row["stop_reason_text"] is None else row["stop_reason_text"],
            "rollout_id": row["rollout_id"], "weight_version": row["weight_version"],
            "token_ids": row["completion_token_ids"],
        })
    return {"id": f"chatcmpl-{turn_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(rows), "session_id": session_id, "turn": turn}


def text_answer(rows: list[dict[str, Any]], *, turn_id: str, model: str, session_id: str, turn: int, text_of: Any,
                token_text: TokenText, logprobs: int | None) -> dict[str, Any]:
    """The `text_completion` object for a turn's rows (`turn_rows`; `/v1/completions`)."""
    choices = []
    for row in rows:
        lp = None
        if logprobs is not None:
            tokens = [token_text(t) for t in row["completion_token_ids"]]
            offsets, at = [], 0
            for token in tokens:
                offsets.append(at)
                at += len(token)
            tops = row["completion_top_logprobs"]
            lp = {"tokens": tokens, "token_logprobs": row["completion_logprobs"], "text_offset": offsets,
                  "top_logprobs": None if tops is None else
                  [{token_text(alt["token_id"]): alt["logprob"] for alt in position} for position in tops]}
        choices.append({"index": row["sample_index"], "text": text_of(row), "logprobs": lp,
                        "finish_reason": row["finish_reason"], "rollout_id": row["rollout_id"],
                        "weight_version": row["weight_version"], "token_ids": row["completion_token_ids"]})
    return {"id": f"cmpl-{turn_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(rows), "session_id": session_id, "turn": turn}


def canonical_assistant(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message reduced to what identifies a reply: its content (trimmed; parts joined)
    and its tool calls (name and parsed arguments). Ids, reasoning and formatting are left out, since
    agents send replies back with or without them."""
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(part.get("text") or "" for part in content if isinstance(part, dict)
                           and part.get("type") == "text")
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        calls.append([function.get("name"), arguments])
    return {"content": (content or "").strip(), "tool_calls": calls}

"""Reward functions: which names may run, the built-ins, and the contract.

Only registered functions ever run: the built-ins below, the entry points of the group
`pipeline.rewards` (a package declares `[project.entry-points."pipeline.rewards"] name =
"module:function"`), and the deployment's allow-list `$PIPELINE_REWARDS` (`name=module:function`,
comma-separated). A run names one at submit (`--reward NAME`, checked there) and reward workers
resolve the name again (refusing one they do not have); the queue only ever carries a name, never
an import path.

The contract: `fn(rows) -> rewards`, `rows` a list of dicts (`rollout_id`, `request_id`,
`sample_index`, `completion_text`, `completion_token_ids`, `finish_reason`, `metadata` (the
request's, as a dict)); it returns one entry per row, a float or a `(float, dict)` pair whose dict
is stored as the row's `reward_info` JSON. Built-ins: `exact_match` (completion text equals
`metadata["answer"]`, both stripped) and `numeric_match` (the last number of the completion, or
the content of its last `\\boxed{...}`, equals `metadata["answer"]` numerically).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from pipeline.core import settings
from pipeline.core.errors import RewardNameError

ENTRY_POINT_GROUP = "pipeline.rewards"
ENV_REWARDS = settings.REWARDS.name

RewardRow = dict[str, Any]
RewardFunction = Callable[[list[RewardRow]], Sequence[float | tuple[float, Mapping[str, Any]]]]


def _answer(row: RewardRow, function: str) -> str:
    metadata = row.get("metadata") or {}
    if "answer" not in metadata:
        raise ValueError(f"{function}: request {row['request_id']!r} has no metadata 'answer' (the ground truth)")
    return str(metadata["answer"]).strip()


def _text(row: RewardRow, function: str) -> str:
    text = row.get("completion_text")
    if text is None:
        raise ValueError(f"{function}: rollout {row['rollout_id']!r} has no completion_text (its worker had no "
                         "tokenizer); run the worker with the model's tokenizer")
    return str(text)


def exact_match(rows: list[RewardRow]) -> list[float]:
    """1.0 where the completion text equals `metadata["answer"]` (both stripped), else 0.0."""
    return [1.0 if _text(row, "exact_match").strip() == _answer(row, "exact_match") else 0.0 for row in rows]


# A '-' right after a digit is a range or a subtraction ("0-3"), not the sign of the next number.
_NUMBER = re.compile(r"(?<![\d.])(?:-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _number(text: str) -> float | None:
    boxed = _BOXED.findall(text)
    found = _NUMBER.findall(boxed[-1] if boxed else text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_match(rows: list[RewardRow]) -> list[tuple[float, dict[str, Any]]]:
    """1.0 where the completion's answer (last `\\boxed{}` else last number) equals `metadata["answer"]`
    numerically (relative tolerance 1e-6), else 0.0; `reward_info` holds what was extracted."""
    rewards: list[tuple[float, dict[str, Any]]] = []
    for row in rows:
        truth = _number(_answer(row, "numeric_match"))
        if truth is None:
            raise ValueError(f"numeric_match: request {row['request_id']!r}: metadata 'answer' is not a number")
        got = _number(_text(row, "numeric_match"))
        same = got is not None and math.isclose(got, truth, rel_tol=1e-6, abs_tol=1e-9)
        rewards.append((1.0 if same else 0.0, {"extracted": got}))
    return rewards


BUILTINS: dict[str, RewardFunction] = {"exact_match": exact_match, "numeric_match": numeric_match}


def _allow_list() -> dict[str, str]:
    """`$PIPELINE_REWARDS` as name → `module:function`."""
    found: dict[str, str] = {}
    for item in settings.rewards():
        name, _, target = item.partition("=")
        if not name.strip() or ":" not in target:
            raise RewardNameError(f"${ENV_REWARDS}: {item!r} is not name=module:function")
        found[name.strip()] = target.strip()
    return found


def registered() -> list[str]:
    """Every reward function name registered here."""
    return sorted({*BUILTINS, *(e.name for e in entry_points(group=ENTRY_POINT_GROUP)), *_allow_list()})


def check_registered(name: str) -> None:
    """`RewardNameError` unless `name` is registered here."""
    if name not in registered():
        raise RewardNameError(
            f"reward function {name!r} is not registered (registered: {', '.join(registered())}); register it "
            f"in the entry-point group {ENTRY_POINT_GROUP!r} or in ${ENV_REWARDS} (name=module:function)"
        )


def resolve(name: str) -> RewardFunction:
    """The registered function called `name` (`RewardNameError` if there is none)."""
    check_registered(name)
    if name in BUILTINS:
        return BUILTINS[name]
    allowed = _allow_list()
    if name in allowed:
        module, _, attr = allowed[name].partition(":")
        function = getattr(importlib.import_module(module), attr)
    else:
        function = next(e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == name).load()
    if not callable(function):
        raise RewardNameError(f"reward function {name!r} resolves to {function!r}, which is not callable")
    return function


def normalise(name: str, rows: int, returned: Any) -> list[tuple[float, Mapping[str, Any] | None]]:
    """A reward function's return value as (reward, info) per row; `ValueError` saying what is wrong."""
    if not isinstance(returned, Sequence) or isinstance(returned, str | bytes) or len(returned) != rows:
        size = len(returned) if isinstance(returned, Sequence) else type(returned).__name__
        raise ValueError(f"reward function {name!r} returned {size} for {rows} rows; return one reward per row")
    out: list[tuple[float, Mapping[str, Any] | None]] = []
    for index, item in enumerate(returned):
        reward, info = (item[0], item[1]) if isinstance(item, tuple) and len(item) == 2 else (item, None)
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"reward function {name!r}: row {index}: reward {reward!r} is not a finite number")
        if info is not None and not isinstance(info, Mapping):
            raise ValueError(f"reward function {name!r}: row {index}: info {info!r} is not a dict")
        out.append((float(reward), info))
    return out

"""Naming an agent: `package.module:function`, imported by that name.

The module is found on the path or in the current directory (as uvicorn finds `main:app`).
Submit imports it before anything is enqueued (a typo, a missing package or a module that fails
to import is an error there, not a queue of failed episodes); an agent worker imports the agents
it was started with, and runs only those: the queue carries the name, and a worker never imports
a name it read from Redis.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from pipeline.core.errors import AgentImportError
from schemas.episode import check_agent_path


def load(path: str, what: str = "agent") -> Callable[..., Any]:
    """The callable `path` names; `AgentImportError` saying what failed and what to do."""
    try:
        check_agent_path(path, what)
    except ValueError as exc:
        raise AgentImportError(str(exc)) from None
    module_name, attribute = path.split(":", 1)
    _with_working_directory()
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise AgentImportError(
            f"{what} {path!r}: no module named {missing!r} (is the package installed in this environment, or "
            f"its folder on PYTHONPATH? searched {len(sys.path)} paths)") from None
    except Exception as exc:  # the module itself raised while importing
        raise AgentImportError(f"{what} {path!r}: importing {module_name!r} raised "
                               f"{type(exc).__name__}: {exc}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            names = sorted(n for n in dir(target) if not n.startswith("_"))
            raise AgentImportError(f"{what} {path!r}: {module_name!r} has no attribute {part!r} (it has: "
                                   f"{', '.join(names[:12])}{' ...' if len(names) > 12 else ''})")
        target = getattr(target, part)
    if not callable(target):
        raise AgentImportError(f"{what} {path!r} is a {type(target).__name__}, not a function")
    return target


def _with_working_directory() -> None:
    """Agents are found in the current directory too, as uvicorn finds `main:app` (a console script
    such as `pipeline` does not put it on the path by itself)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` gives a coroutine (an `async def`, or an object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

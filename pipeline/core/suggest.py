"""'Did you mean': the known names closest to a mistyped one, for error messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

SHOWN = 10
# Names from OpenAI's and other engines' APIs (and their flags), and the name a request field (or
# `pipeline submit`'s flag, `--n-samples` for `n_samples`) has here.
OTHER_NAMES = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
    "stop_sequences": "stop", "top_logprobs": "logprobs", "prompt_token_ids": "input_ids",
    "prompt_ids": "input_ids", "num_samples": "n", "n_samples": "n", "num_return_sequences": "n",
}


def did_you_mean(name: str, known: Iterable[str], *, aliases: dict[str, str] | None = None) -> str:
    """`"; did you mean 'x'?"` naming the known name closest to `name` (or its alias), else ""."""
    candidates = sorted(set(known))
    if aliases and name in aliases:
        close = [aliases[name]]
    else:
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def listing(names: Iterable[str]) -> str:
    """The first names, sorted, comma-separated ("..." when there are more), or "nothing"."""
    ordered = sorted(set(names))
    if not ordered:
        return "nothing"
    return ", ".join(ordered[:SHOWN]) + (f", ... ({len(ordered)} in all)" if len(ordered) > SHOWN else "")


def missing_file(path: Path, what: str) -> str:
    """Why `path` cannot be read: it does not exist; the closest name in its directory, if any."""
    folder = path.parent
    if not folder.is_dir():
        return f"no such file: {path} (its directory {folder} does not exist either); give the path of {what}"
    return f"no such file: {path}{did_you_mean(path.name, (p.name for p in folder.iterdir()))}; give the path of {what}"

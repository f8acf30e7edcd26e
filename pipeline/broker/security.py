"""Who may steer workers, and where they may read weights and write shards.

Configured by environment variables, read on every use (so tests and long-lived processes
see changes):

- `PIPELINE_CONTROL_SECRET` (or `PIPELINE_CONTROL_SECRET_FILE`): a shared secret; the desired
  state and weight acks are then signed (HMAC-SHA256) and unsigned or forged ones refused.
- `PIPELINE_ALLOWED_WEIGHT_PREFIXES`: comma-separated path or URL prefixes weights may be
  loaded from (trainers refuse to push others; workers refuse to load them).
- `PIPELINE_ALLOWED_OUTPUT_SCHEMES` (e.g. `s3,gs,file`) and `PIPELINE_ALLOWED_OUTPUT_PREFIXES`
  (URL prefixes): where shards may be written (checked at submit and again by the worker).

Unset means unrestricted. Paths with `..` segments are refused whenever a prefix list is set.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from pipeline.errors import PolicyError

ENV_SECRET = "PIPELINE_CONTROL_SECRET"
ENV_SECRET_FILE = "PIPELINE_CONTROL_SECRET_FILE"
ENV_WEIGHT_PREFIXES = "PIPELINE_ALLOWED_WEIGHT_PREFIXES"
ENV_OUTPUT_SCHEMES = "PIPELINE_ALLOWED_OUTPUT_SCHEMES"
ENV_OUTPUT_PREFIXES = "PIPELINE_ALLOWED_OUTPUT_PREFIXES"


def control_secret() -> bytes | None:
    """The shared control secret, or None when control messages are not authenticated."""
    value = os.environ.get(ENV_SECRET)
    if not value and os.environ.get(ENV_SECRET_FILE):
        value = Path(os.environ[ENV_SECRET_FILE]).read_text().strip()
    return value.encode() if value else None


def _listed(env: str) -> list[str]:
    return [item.strip() for item in os.environ.get(env, "").split(",") if item.strip()]


def scheme_of(url: str) -> str:
    """The fsspec protocol of a URL (`file` for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _normalized(value: str) -> str:
    if "://" in value:
        scheme, rest = value.split("://", 1)
        return f"{scheme.lower()}://{posixpath.normpath(rest) if rest else rest}"
    return posixpath.normpath(value)


def _has_parent_segment(value: str) -> bool:
    rest = value.split("://", 1)[-1]
    return ".." in rest.replace("\\", "/").split("/")


def within(value: str, prefixes: list[str]) -> bool:
    """Whether `value` is one of `prefixes` or below one (path-component boundaries, no `..`)."""
    if _has_parent_segment(value):
        return False
    target = _normalized(value)
    for prefix in prefixes:
        base = _normalized(prefix).rstrip("/")
        if target == base or target.startswith(base + "/"):
            return True
    return False


def check_weight_path(path: str) -> None:
    """Raise `PolicyError` unless weights may be loaded from `path`."""
    prefixes = _listed(ENV_WEIGHT_PREFIXES)
    if prefixes and not within(str(path), prefixes):
        raise PolicyError(
            f"weight path {path!r} is outside the allowed prefixes {prefixes} "
            f"(${ENV_WEIGHT_PREFIXES}); copy the checkpoint under one of them"
        )


def check_output_url(url: str) -> None:
    """Raise `PolicyError` unless shards may be written under `url`."""
    schemes = [s.lower() for s in _listed(ENV_OUTPUT_SCHEMES)]
    if schemes:
        used = [scheme_of(part) for part in url.split("::")]
        refused = [s for s in used if s not in schemes]
        if refused:
            raise PolicyError(
                f"output URL {url!r} uses scheme {refused[0]!r}; allowed: {schemes} (${ENV_OUTPUT_SCHEMES})"
            )
    prefixes = _listed(ENV_OUTPUT_PREFIXES)
    if prefixes and not within(url, prefixes):
        raise PolicyError(
            f"output URL {url!r} is outside the allowed prefixes {prefixes} (${ENV_OUTPUT_PREFIXES})"
        )

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

import posixpath

from pipeline.core import settings
from pipeline.core.errors import PolicyError

ENV_WEIGHT_PREFIXES = settings.ALLOWED_WEIGHT_PREFIXES.name
ENV_OUTPUT_SCHEMES = settings.ALLOWED_OUTPUT_SCHEMES.name
ENV_OUTPUT_PREFIXES = settings.ALLOWED_OUTPUT_PREFIXES.name


def control_secret() -> bytes | None:
    """The shared control secret, or None when control messages are not authenticated."""
    value = settings.control_secret()
    return value.encode() if value else None


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
    prefixes = settings.allowed_weight_prefixes()
    if prefixes and not within(str(path), prefixes):
        raise PolicyError(
            f"weight path {path!r} is outside the allowed prefixes {prefixes} "
            f"(${ENV_WEIGHT_PREFIXES}); copy the checkpoint under one of them"
        )


def check_output_url(url: str) -> None:
    """Raise `PolicyError` unless shards may be written under `url`."""
    schemes = [s.lower() for s in settings.allowed_output_schemes()]
    if schemes:
        used = [scheme_of(part) for part in url.split("::")]
        refused = [s for s in used if s not in schemes]
        if refused:
            raise PolicyError(
                f"output URL {url!r} uses scheme {refused[0]!r}; allowed: {schemes} (${ENV_OUTPUT_SCHEMES})"
            )
    prefixes = settings.allowed_output_prefixes()
    if prefixes and not within(url, prefixes):
        raise PolicyError(
            f"output URL {url!r} is outside the allowed prefixes {prefixes} (${ENV_OUTPUT_PREFIXES})"
        )

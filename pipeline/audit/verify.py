"""`pipeline.verify(...)`: the trainer-side name of the `workers` implementation.

Recomputing logprobs needs torch and transformers, which live above `pipeline` (in `workers`),
so the function is found through the `pipeline.api` entry point group, as subcommands are
through `pipeline.commands`: `import pipeline` never imports them.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.core.verify_stats import VerifyReport


def verify(source: str, model: Any, **options: Any) -> VerifyReport:
    """Recompute the stored completion logprobs of `source` (a run name with `conn=`, a URL or a
    directory of shards) with the reference `model` (a path, or {version: path}); see
    `workers.audit.recompute.verify` for the options (`rows`, `seed`, `device`, `threshold`, `worst`,
    `conn`, `memory_mb`). Returns a `VerifyReport`; `report.table` has one row per weight
    version and engine."""
    found = [e for e in entry_points(group="pipeline.api") if e.name == "verify"]
    if not found:
        raise PipelineError("pipeline.verify needs the workers package installed with torch and transformers "
                            "(pip install 'rollout-pipeline[hf]')")
    return found[0].load()(source, model, **options)

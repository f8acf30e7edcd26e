"""Module paths of the releases before the packages were grouped into wings keep importing.

`import pipeline.torch_data` (or `from pipeline.take import rewards_differ`) gives the module where
it lives now (`pipeline.read.torch_data`), with a `DeprecationWarning` naming the new path; one
finder on `sys.meta_path` does it, so no stub module sits beside the real one. Names that are also
functions of the `pipeline` package (`pipeline.verify`, `pipeline.report`, `pipeline.routed_experts`)
keep meaning the functions. Jobs queued by earlier releases name their job function by its old
path; `workers.jobs.allowed_job` maps those.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    **{f"pipeline.{name}": f"pipeline.submit.{new}" for name, new in {
        "submit": "submit", "request_file": "request_file", "dataset_input": "dataset_input",
        "dataset_source": "dataset_source", "chat": "render", "prompt_staging": "prompt_staging",
        "capabilities": "placement"}.items()},
    **{f"pipeline.{name}": f"pipeline.core.broker.{new}" for name, new in {
        "connection": "connection", "keys": "keys", "replication": "replication", "sentinel_url": "sentinel_url",
        "commit_log": "commit_log", "reward_log": "reward_log", "registry": "registry", "security": "security",
        "redis_server": "redis_server", "control": "control_channel"}.items()},
    **{f"pipeline.{name}": f"pipeline.read.{name}" for name in (
        "reader", "follow", "batch", "take", "cancel", "torch_data", "importance", "storage", "progress", "rewards")},
    **{f"pipeline.{name}": f"pipeline.audit.{name}" for name in ("verify_stats", "status", "display")},
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module is the one at its new path, already executed."""


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

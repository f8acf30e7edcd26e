"""The direction of imports the layout promises: `schemas` imports nothing of ours; `pipeline.core`
(what both sides stand on) imports only itself and `schemas`; the trainer's side (the rest of
`pipeline`) never imports `workers`; `workers` imports only `pipeline.core` and `schemas`; and no two
sub-packages import each other. Read from the source, so a lazy import inside a function counts."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "pipeline", "workers")

# The one module that plays both sides on purpose: the demo submits as a trainer and runs a worker in
# the same process, so that one `pipeline demo` shows the whole loop.
BOTH_SIDES = {"workers.demo.run": {"pipeline.client"}}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of ours → the modules of ours it imports (a `from a import b` counts `a.b` when
    `a.b` is a module, else `a`)."""
    found: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = _module(path)
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [_as_module(f"{node.module}.{alias.name}") or node.module for alias in node.names]
                found[source].update(t for t in targets if t.split(".")[0] in PACKAGES)
    return found


def _as_module(dotted: str) -> str | None:
    path = ROOT.joinpath(*dotted.split("."))
    return dotted if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else None


def _layer(module: str) -> str:
    if module.startswith("pipeline.core"):
        return "core"
    return {"schemas": "schemas", "pipeline": "trainer", "workers": "workers"}[module.split(".")[0]]


ALLOWED = {
    "schemas": {"schemas"},
    "core": {"core", "schemas"},
    "trainer": {"trainer", "core", "schemas"},
    "workers": {"workers", "core", "schemas"},
}


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for source, targets in sorted(_imports().items()):
        for target in sorted(targets):
            if target == "pipeline" or target in BOTH_SIDES.get(source, set()):
                continue  # the package itself: its attributes are the curated, lazy public API
            if _layer(target) not in ALLOWED[_layer(source)]:
                wrong.append(f"{source} ({_layer(source)}) imports {target} ({_layer(target)})")
    assert not wrong, "\n".join(wrong)


def _subpackage(module: str) -> str:
    """`pipeline.core.broker.keys` → `pipeline.core.broker`; `workers.jobs.feeder` → `workers.jobs`."""
    parts = module.split(".")
    depth = 3 if parts[:2] == ["pipeline", "core"] else 2
    name = ".".join(parts[:depth])
    return name if (ROOT.joinpath(*name.split(".")) / "__init__.py").exists() else ".".join(parts[:depth - 1])


def test_no_two_sub_packages_import_each_other() -> None:
    edges: set[tuple[str, str]] = set()
    for source, targets in _imports().items():
        for target in targets:
            a, b = _subpackage(source), _subpackage(target)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                edges.add((a, b))
    both_ways = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not both_ways, "\n".join(both_ways)


def test_a_worker_importing_the_shared_package_loads_none_of_the_trainers_side() -> None:
    probe = ("import sys, pipeline.core.settings, pipeline.core.jobs.queue, workers.process.worker;"
             "print('\\n'.join(m for m in sys.modules if m.startswith('pipeline')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    trainer = [m for m in loaded.stdout.split() if m != "pipeline" and not m.startswith("pipeline.core")]
    assert not trainer, f"a worker's imports pulled in the trainer's side: {trainer}"


def test_import_pipeline_loads_only_the_package_until_a_name_is_used() -> None:
    probe = ("import sys, pipeline; before = sorted(m for m in sys.modules if m.startswith('pipeline'));"
             "pipeline.connect; print(before, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['pipeline'] False False"

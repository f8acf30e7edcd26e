"""The demo model by name: `demo` (SmolLM2-135M-Instruct, converted by `pipeline demo`) and
`demo-perturbed` (the demo's "next checkpoint") stand for their cached directories wherever the
command line takes a model or tokenizer path (`--tokenizer`, `worker --model`, `verify --model`,
`weights push`, `report --verify-model`): `resolve` is the one resolver every command uses.

Only where they are is known here (`settings.model_cache()`); converting the model is
`workers.engines.hf.demo_model`'s job, so the trainer side loads nothing to resolve a name.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core import settings
from pipeline.core.errors import PipelineError

DEMO_DIR = "smollm2-135m-instruct"
# Name on the command line → directory under the model cache.
NAMES = {"demo": DEMO_DIR, "demo-perturbed": f"{DEMO_DIR}-perturbed"}


def demo_dir(name: str = "demo") -> Path:
    """Where the demo model called `name` lives (whether or not it was converted yet)."""
    return settings.model_cache() / NAMES[name]


def resolve(value: str) -> str:
    """`value`, or the directory of the demo model it names; `PipelineError` saying how to make it
    when it names one that is not on disk yet. A path that exists is never taken for a name."""
    if value not in NAMES or Path(value).exists():
        return value
    path = demo_dir(value)
    if not (path / "config.json").exists():
        raise PipelineError(f"{value!r} names the demo model at {path}, which is not there yet: run `pipeline demo` "
                            "(or `make demo`) once to convert it")
    return str(path)


def resolve_versioned(value: str) -> str:
    """`resolve` for a `PATH` or `V=PATH` option value (verify's `--model`): the path part resolved."""
    version, sep, path = value.partition("=")
    if sep and version.strip().lstrip("-").isdigit():
        return f"{version}={resolve(path)}"
    return resolve(value)

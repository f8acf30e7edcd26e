"""A PEFT LoRA adapter read and checked: from a directory, or a peft model in memory.

What `peft`'s `save_pretrained` writes (and SGLang's and vLLM's LoRA loaders read):
`adapter_config.json` (`peft_type` "LORA", `r`, `target_modules`) and `adapter_model.safetensors`,
whose tensors are `base_model.model.<module>.lora_A.weight` (rank x in) and `...lora_B.weight`
(out x rank) for each adapted linear module. `check_fits` refuses an adapter that does not fit
the base model, naming the module: a target the base does not have, a rank other than the
config's, or in/out sizes other than the base weight's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from pipeline.core.adapters import CONFIG_FILE, target_modules
from pipeline.core.errors import AdapterError, WeightStoreError
from pipeline.core.weights.safetensors_io import TensorBits, read_checkpoint, read_header

WEIGHTS_FILE = "adapter_model.safetensors"
_LORA_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class Adapter:
    """An adapter's config (as peft writes it, JSON-ready) and its tensors, checked to be LoRA."""

    config: dict[str, Any]
    tensors: list[TensorBits]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def target_modules(self) -> list[str]:
        return target_modules(self.config)

    @property
    def nbytes(self) -> int:
        return sum(t.words.nbytes for t in self.tensors)


def read_dir(path: str | Path) -> Adapter:
    """The adapter in a directory `save_pretrained` wrote; `AdapterError` saying what is missing."""
    root = Path(path)
    where = f"{root}: not a PEFT adapter directory"
    if not root.is_dir():
        raise AdapterError(f"{where} (no such directory); give the directory peft's save_pretrained wrote")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (root / name).is_file()]
    if missing:
        raise AdapterError(f"{where} (no {' and no '.join(missing)}); give the directory peft's save_pretrained "
                           "wrote")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise AdapterError(f"{root / CONFIG_FILE}: not JSON ({exc})") from exc
    try:
        tensors = list(read_checkpoint(f"file://{root}"))
    except WeightStoreError as exc:
        raise AdapterError(f"{root / WEIGHTS_FILE}: {exc}") from exc
    return checked(config, tensors, str(root))


def from_model(model: Any, adapter_name: str = "default") -> Adapter:
    """The adapter `adapter_name` of a peft model in memory (its LoRA tensors, copied to the CPU)."""
    from peft import get_peft_model_state_dict

    from pipeline.core.weights.torch_bits import to_bits

    configs = getattr(model, "peft_config", None)
    if not configs or adapter_name not in configs:
        raise AdapterError(f"{type(model).__name__} has no peft adapter {adapter_name!r} "
                           f"(adapters: {sorted(configs or {})}); wrap the model with peft.get_peft_model")
    config = json.loads(json.dumps(configs[adapter_name].to_dict(), default=_jsonable))
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return checked(config, [to_bits(name, tensor) for name, tensor in state.items()], f"peft adapter {adapter_name!r}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


def checked(config: Any, tensors: list[TensorBits], where: str) -> Adapter:
    """`Adapter` when `config` is a LoRA config and every tensor a LoRA A or B matrix of its rank."""
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise AdapterError(f"{where}: a {kind!r} adapter; only LoRA adapters (peft_type LORA) are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: {CONFIG_FILE} has no rank r (a positive integer), got {rank!r}")
    if not tensors:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no tensor")
    for tensor in tensors:
        match = _LORA_TENSOR.match(tensor.name)
        if match is None:
            raise AdapterError(f"{where}: tensor {tensor.name} is not a LoRA A or B matrix "
                               "(base_model.model.<module>.lora_A.weight); only LoRA on linear layers is served")
        if len(tensor.shape) != 2:
            raise AdapterError(f"{where}: tensor {tensor.name} has shape {list(tensor.shape)}, not a matrix")
        side = tensor.shape[0] if match["part"] == "A" else tensor.shape[1]
        if side != rank:
            raise AdapterError(f"{where}: module {match['module']}: lora_{match['part']} has rank {side}, "
                               f"the config's r is {rank}")
    return Adapter(config, tensors)


def base_shapes_of_dir(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a model directory's safetensors files (headers only)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    files = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".safetensors"))
    if not files:
        raise AdapterError(f"{path}: no *.safetensors file; the base model the adapter is checked against is "
                           "a model directory")
    return {name: entry[1] for file in files for name, entry in read_header(fs, file).items()}


def check_fits(adapter: Adapter, base: Mapping[str, tuple[int, ...]], where: str) -> None:
    """`AdapterError` naming the module when the adapter does not fit the base model's shapes."""
    modules = {name[: -len(".weight")] for name in base if name.endswith(".weight")}
    for target in adapter.target_modules:
        if not any(m == target or m.endswith(f".{target}") for m in modules):
            raise AdapterError(f"{where}: target module {target!r} is not in the base model; its linear modules "
                               f"end in {_suffixes(modules)}")
    for tensor in adapter.tensors:
        match = _LORA_TENSOR.match(tensor.name)
        assert match is not None  # `checked` refused anything else
        module = match["module"]
        shape = base.get(f"{module}.weight")
        if shape is None or len(shape) != 2:
            raise AdapterError(f"{where}: module {module} is not a linear layer of the base model; "
                               "was the adapter trained on another model?")
        out, inp = shape
        got, want = (tensor.shape[1], inp) if match["part"] == "A" else (tensor.shape[0], out)
        if got != want:
            side = "in" if match["part"] == "A" else "out"
            raise AdapterError(f"{where}: module {module}: lora_{match['part']} has {got} {side} features, the "
                               f"base model's weight {list(shape)} has {want}; was the adapter trained on another "
                               "model?")


def _suffixes(modules: Iterable[str]) -> str:
    return ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules})[:20])

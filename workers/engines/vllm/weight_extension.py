"""The vLLM worker extension that applies weight-store versions (`pipeline.weights`) inside vLLM's workers.

Start the server with `--worker-extension-cls workers.engines.vllm.weight_extension.RolloutWeightExtension`
(this checkout on its `PYTHONPATH`, or the project installed with `--no-deps` in vLLM's venv): vLLM
mixes the class into its worker, and `POST /collective_rpc {"method": "rollout_apply_store", "args":
[PLAN]}` runs `rollout_apply_store` in every worker. The `vllm-http` engine sends it
(`VLLMHTTPEngine.apply_store_version`) while the server is paused.

It runs in vLLM's own venv, so it imports only stdlib, numpy, torch, fsspec and the store's
decoding core (`pipeline/weights/codec_core.py`, loaded by its path: numpy, zstandard, xxhash),
never the `pipeline` package (redis, pyarrow). The plan is JSON the adapter built from the
store's validated manifests: the blobs' paths and spans, each tensor's encoding and the checksum
of every tensor at the new version.

vLLM's CPU kernels keep linear weights only in a packed form (the parameter itself is emptied
after loading, `dispatch_cpu_unquantized_gemm`), so the weights cannot be read back and changed
in place there. The extension keeps the checkpoint-named tensors of the version it serves (the
*shadow*, host memory of one model copy), applies a delta to the shadow in place, checks every
tensor's checksum there, and only then feeds vLLM the tensors of every layer that changed through
its own in-place reload (`reload_weights(weights_iterator=...)`: the name mapping to fused
`qkv_proj`/`gate_up_proj`, the repacking); a layer whose tensors did not change is not touched.
A delta that does not decode or leaves a checksum different falls back to a full rebuild of the
shadow from the store (reported); a full rebuild that still differs is refused before vLLM sees a
byte. Afterwards every tensor vLLM still holds as a readable parameter (embeddings, norms,
`lm_head`; on a GPU all of them) is read back and compared with the checksum.

Nothing here raises into vLLM: an exception in a `collective_rpc` method kills vLLM's engine, so
each call answers `{"ok": false, "error": ...}` instead.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import fsspec
import numpy as np
import torch

log = logging.getLogger(__name__)

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_core: ModuleType | None = None


def codec_core() -> ModuleType:
    """`pipeline/weights/codec_core.py`, loaded by its path (finding `pipeline` does not import it)."""
    global _core
    if _core is None:
        spec = importlib.util.find_spec("pipeline")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("the rollout pipeline's `pipeline` package is not on this vLLM worker's path: put the "
                              "checkout on PYTHONPATH or pip install it --no-deps into vLLM's venv")
        path = Path(next(iter(spec.submodule_search_locations))) / "weights" / "codec_core.py"
        module_spec = importlib.util.spec_from_file_location("rollout_pipeline_codec_core", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _core = module
    return _core


def torch_dtype(name: str) -> torch.dtype:
    from safetensors.torch import _TYPES  # safetensors' own name -> torch dtype table

    return _TYPES[name]


def to_torch(words: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor sharing `words`' memory, as `dtype` (a safetensors name)."""
    signed = torch.from_numpy(words.view(np.dtype(f"i{words.dtype.itemsize}")))
    value = signed.view(torch.uint8).view(torch.bool) if dtype == "BOOL" else signed.view(torch_dtype(dtype))
    return value.reshape(shape)


def to_words(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """A CPU copy of a tensor's bits as the unsigned words of `dtype` (a safetensors name)."""
    value = tensor.detach().to("cpu").contiguous().reshape(-1)
    signed = value.view(torch.uint8) if value.dtype == torch.bool else value.view(_SIGNED[value.element_size()])
    return signed.numpy().view(codec_core().word_type(dtype))


class _Store:
    """Reads the plan's blobs (one fsspec filesystem) and counts the bytes."""

    def __init__(self, url: str) -> None:
        self.fs, _ = fsspec.core.url_to_fs(url)
        self.bytes_read = 0

    def blob(self, step: dict[str, Any], entry: dict[str, Any]) -> bytes:
        if not entry.get("file") or not entry["length"]:
            return b""
        path = f"{step['dir']}/{entry['file']}"
        data = self.fs.cat_file(path, start=entry["offset"], end=entry["offset"] + entry["length"])
        if len(data) != entry["length"]:
            raise ValueError(f"{path}: {len(data)} bytes at offset {entry['offset']}, {entry['length']} expected")
        self.bytes_read += len(data)
        return data


def apply_steps(shadow: dict[str, np.ndarray], steps: list[dict[str, Any]], store: _Store) -> set[str]:
    """Apply each step's entries to `shadow` (plain: the bits themselves); the names written."""
    core = codec_core()
    written: set[str] = set()
    for step in steps:
        for entry in step["tensors"]:
            name, encoding = entry["name"], entry["encoding"]
            if encoding == "same":
                continue
            word = core.word_type(entry["dtype"])
            count = int(np.prod(entry["shape"], dtype=np.int64))
            blob = store.blob(step, entry)
            if encoding == "plain":
                if len(blob) != count * np.dtype(word).itemsize:
                    raise core.DecodeError(f"{name}: {len(blob)} plain bytes for {count} elements")
                shadow[name] = np.frombuffer(blob, word).copy()
            else:
                words = shadow.get(name)
                if words is None or words.dtype != np.dtype(word) or words.size != count:
                    if encoding != "raw":
                        raise core.DecodeError(f"{name}: a {encoding} delta of a tensor the version before does not "
                                               "have with that dtype and shape")
                    words = shadow[name] = np.empty(count, word)
                try:
                    core.apply(encoding, blob, words)
                except core.DecodeError as exc:
                    raise core.DecodeError(f"{step['dir']}: tensor {name}: {exc}") from exc
            written.add(name)
    return written


def mismatched(shadow: dict[str, np.ndarray], final: list[dict[str, Any]]) -> list[str]:
    checksum = codec_core().checksum
    return [e["name"] for e in final if e["name"] not in shadow or checksum(shadow[e["name"]]) != e["xxh3"]]


class _Layout:
    """Where a checkpoint-named tensor lives in vLLM's model: its parameter, and for a fused one
    (`q_proj` in `qkv_proj`, `gate_proj` in `gate_up_proj`) the rows of its shard."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)

    def locate(self, name: str) -> tuple[str, Any]:
        """(vLLM parameter name, shard id or None)."""
        if self.mapper is not None:
            mapped = self.mapper._map_name_with_shard(name)
            if mapped is not None:
                return mapped[0], mapped[1]
        return name, None

    def module_of(self, name: str) -> str:
        return self.locate(name)[0].rpartition(".")[0]

    def read(self, name: str) -> torch.Tensor | None:
        """The tensor as vLLM holds it, or None where it cannot be read (a packed CPU weight, tensor parallel)."""
        target, shard = self.locate(name)
        try:
            param = self.model.get_parameter(target)
        except AttributeError:
            return None
        if param.is_meta or param.numel() == 0:
            return None
        if shard is None:
            return param
        module = self.model.get_submodule(target.rpartition(".")[0])
        if getattr(module, "tp_size", 1) != 1:
            return None
        if isinstance(shard, str) and hasattr(module, "_get_shard_offset_mapping"):
            offset, size = module._get_shard_offset_mapping(shard), module._get_shard_size_mapping(shard)
        elif isinstance(shard, int) and hasattr(module, "output_sizes"):
            offset, size = sum(module.output_sizes[:shard]), module.output_sizes[shard]
        else:
            return None
        return param.narrow(getattr(param, "output_dim", 0), offset, size)


class RolloutWeightExtension:
    """Mixed into vLLM's worker class; its methods are what `/collective_rpc` may call by name."""

    def _rollout_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_rollout_weights")
        if state is None:
            state = self.__dict__["_rollout_weights"] = {"url": None, "version": None, "shadow": {}, "meta": {}}
        return state

    def _rollout_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def rollout_apply_store(self, plan: str) -> dict[str, Any]:
        """Bring this worker's weights to the plan's version (a JSON string: see the module docstring)."""
        state = self._rollout_state()
        try:
            return self._rollout_apply(state, json.loads(plan))
        except Exception as exc:  # anything raised here would kill vLLM's engine
            log.exception("rollout_apply_store failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "version": state["version"]}

    def _rollout_apply(self, state: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
        core = codec_core()
        started = time.perf_counter()
        shadow: dict[str, np.ndarray] = state["shadow"]
        final = plan["final"]
        store = _Store(plan["url"])
        how, detail, changed = None, None, set()
        if plan.get("deltas") and shadow and (state["url"], state["version"]) == (plan["url"], plan["have"]):
            try:
                changed = apply_steps(shadow, plan["deltas"], store)
                bad = mismatched(shadow, final)
            except core.DecodeError as exc:
                bad = [str(exc)]
            if not bad:
                how = "delta"
            else:
                detail = (f"the delta from v{plan['have']} left {len(bad)} tensor(s) not bit-identical to the "
                          f"trainer's (e.g. {bad[0]}); rebuilt from the full version")
                log.warning("weights v%d from %s: %s", plan["version"], plan["url"], detail)
        elif state["version"] is None or not shadow or state["url"] != plan["url"]:
            detail = "no version of this store loaded in the vLLM worker: rebuilt from the full version"
        else:
            detail = (f"the store has no delta chain from the vLLM worker's v{state['version']} to "
                      f"v{plan['version']}: rebuilt from the full version")
        if how is None:
            state["version"] = None
            shadow.clear()
            apply_steps(shadow, plan["chain"], store)
            bad = mismatched(shadow, final)
            if bad:
                shadow.clear()
                return {"ok": False, "version": None, "error": (
                    f"{plan['url']} v{plan['version']}: after a full rebuild {len(bad)} tensor(s) are not "
                    f"bit-identical to the trainer's (e.g. {bad[0]}): the store is corrupt; vLLM's weights were "
                    "not touched; push the weights again as a new full version")}
            how, changed = "full", set(shadow)
        state["meta"] = {e["name"]: (e["dtype"], e["shape"]) for e in final}
        decoded = time.perf_counter()
        state["version"] = None  # until vLLM holds the shadow's version
        fed = self._rollout_feed(state, changed)
        state["url"], state["version"] = plan["url"], plan["version"]
        loaded = time.perf_counter()
        engine = self._rollout_engine_checksums(state)
        wrong = [e["name"] for e in final if engine.get(e["name"]) not in (None, e["xxh3"])]
        result = {"ok": not wrong, "version": plan["version"], "how": how, "detail": detail,
                  "bytes_read": store.bytes_read, "tensors_changed": len(changed), "tensors_fed": fed,
                  "checked_in_engine": sum(1 for v in engine.values() if v is not None),
                  "not_readable_in_engine": sum(1 for v in engine.values() if v is None),
                  "seconds": {"decode": decoded - started, "load": loaded - decoded,
                              "check": time.perf_counter() - loaded}}
        if wrong:
            state["version"] = None
            result["error"] = (f"after loading v{plan['version']}, {len(wrong)} tensor(s) vLLM holds are not the "
                               f"store's bits (e.g. {wrong[0]}): does the server run the store's dtype?")
        return result

    def _rollout_feed(self, state: dict[str, Any], changed: set[str]) -> int:
        """vLLM's in-place reload of every tensor of each layer that holds a changed tensor."""
        layout = _Layout(self._rollout_model())
        layers = {layout.module_of(name) for name in changed}
        names = [name for name in state["shadow"] if layout.module_of(name) in layers]
        if not names:
            return 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                dtype, shape = state["meta"][name]
                yield name, to_torch(state["shadow"][name], dtype, shape)

        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(names)

    def _rollout_engine_checksums(self, state: dict[str, Any]) -> dict[str, str | None]:
        """Each tensor's checksum as vLLM holds it; None where vLLM keeps it unreadable (packed)."""
        layout = _Layout(self._rollout_model())
        checksum = codec_core().checksum
        out: dict[str, str | None] = {}
        for name, (dtype, _shape) in state["meta"].items():
            tensor = layout.read(name)
            if tensor is not None and tuple(tensor.shape) == tuple(_shape) and tensor.dtype == torch_dtype(dtype):
                out[name] = checksum(to_words(tensor, dtype))
            else:
                out[name] = None
        return out

    def rollout_forget_store(self) -> dict[str, Any]:
        """vLLM loaded weights from elsewhere (a checkpoint reload): the next store push rebuilds in full."""
        state = self._rollout_state()
        state.update(url=None, version=None, meta={})
        state["shadow"].clear()
        return {"ok": True}

    def rollout_weight_checksums(self) -> dict[str, Any]:
        """The version this worker serves from the store, each tensor's checksum as the extension holds it
        (`shadow`, what vLLM was fed) and as vLLM holds it (`engine`, null where unreadable)."""
        state = self._rollout_state()
        try:
            checksum = codec_core().checksum
            return {"ok": True, "version": state["version"],
                    "shadow": {name: checksum(words) for name, words in state["shadow"].items()},
                    "engine": self._rollout_engine_checksums(state)}
        except Exception as exc:  # anything raised here would kill vLLM's engine
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

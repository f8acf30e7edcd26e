"""The vLLM worker extension that applies weight-store versions (`pipeline.weights`) inside vLLM's workers.

Start the server with `--worker-extension-cls workers.engines.vllm.weight_extension.RolloutWeightExtension`
(this checkout on its `PYTHONPATH`, or the project installed with `--no-deps` in vLLM's venv): vLLM
mixes the class into its worker, and `POST /collective_rpc {"method": ..., "args": [...]}` runs one
of its methods in every worker. The `vllm-http` engine calls them in two steps, as the hf engine
stages a version (`workers.engines.inplace`):

- `rollout_stage_store(PLAN)` before the pause: it starts preparing the version on a thread of its
  own and answers at once, so vLLM keeps generating (a `collective_rpc` method runs in the worker's
  loop that also runs the model's steps: one that did the work in the call would stop generation
  for as long); `rollout_staged()` says when that is done (`VLLMHTTPEngine.stage_store_version`
  polls it);
- `rollout_install_store(VERSION)` in the pause: vLLM takes the changed layers.

`rollout_apply_store(PLAN)` does both in one call, in the pause (`PIPELINE_WEIGHT_STAGING=off`).

It runs in vLLM's own venv, so it imports only stdlib, numpy, torch, fsspec and the store's
decoding core (`pipeline/core/weights/codec_core.py`, loaded by its path: numpy, zstandard, xxhash),
never the `pipeline` package (redis, pyarrow). The plan is JSON the adapter built from the
store's validated manifests: the blobs' paths and spans, each tensor's encoding and the checksum
of every tensor at the new version.

vLLM's CPU kernels keep linear weights only in a packed form (the parameter itself is emptied
after loading, `dispatch_cpu_unquantized_gemm`), so the weights cannot be read back and changed
in place there. The extension keeps the checkpoint-named tensors of the version it serves (the
*shadow*, host memory of one model copy). Preparing a version: the delta applied to the shadow in
place and every tensor's checksum checked there, then, for each changed layer that vLLM computes
through a oneDNN handle, a new handle built from the shadow and read back through the kernel
(`cpu_kernels`). Installing it: the handles swapped (a pointer each), the changed tensors vLLM
keeps readable (embeddings, norms, `lm_head`; on a GPU all of them) copied into place, and any
changed layer left (another kernel, a layout not known here) fed to vLLM's own in-place reload
(`reload_weights(weights_iterator=...)`: the name mapping to fused `qkv_proj`/`gate_up_proj`, the
repacking); a layer whose tensors did not change is not touched. A delta that does not decode or
leaves a checksum different falls back to a full rebuild of the shadow from the store (reported);
a full rebuild that still differs is refused before vLLM sees a byte. Afterwards every tensor vLLM
holds readable is read back and compared with the checksum.

Nothing here raises into vLLM: an exception in a `collective_rpc` method kills vLLM's engine, so
each call answers `{"ok": false, "error": ...}` instead.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import fsspec
import numpy as np
import torch

from workers.engines.vllm import cpu_kernels

log = logging.getLogger(__name__)

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_core: ModuleType | None = None


def codec_core() -> ModuleType:
    """`pipeline/core/weights/codec_core.py`, loaded by its path (finding `pipeline` does not import it)."""
    global _core
    if _core is None:
        spec = importlib.util.find_spec("pipeline")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("the rollout pipeline's `pipeline` package is not on this vLLM worker's path: put the "
                              "checkout on PYTHONPATH or pip install it --no-deps into vLLM's venv")
        path = Path(next(iter(spec.submodule_search_locations))) / "core" / "weights" / "codec_core.py"
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

    def rows(self, name: str) -> tuple[str, int | None, int | None] | None:
        """(vLLM parameter name, first row, rows) of a checkpoint-named tensor: its rows inside a fused
        parameter, (name, None, None) for a whole one; None where vLLM's layout is not known here
        (tensor parallel, a fused layer of another kind)."""
        target, shard = self.locate(name)
        if shard is None:
            return target, None, None
        try:
            module = self.model.get_submodule(target.rpartition(".")[0])
        except AttributeError:
            return None
        if getattr(module, "tp_size", 1) != 1:
            return None
        if isinstance(shard, str) and hasattr(module, "_get_shard_offset_mapping"):
            return target, module._get_shard_offset_mapping(shard), module._get_shard_size_mapping(shard)
        if isinstance(shard, int) and hasattr(module, "output_sizes"):
            return target, sum(module.output_sizes[:shard]), module.output_sizes[shard]
        return None

    def read(self, name: str) -> torch.Tensor | None:
        """The tensor as vLLM holds it, or None where it cannot be read (a packed CPU weight, tensor parallel)."""
        rows = self.rows(name)
        if rows is None:
            return None
        try:
            param = self.model.get_parameter(rows[0])
        except AttributeError:
            return None
        if param.is_meta or param.numel() == 0:
            return None
        if rows[1] is None:
            return param
        return param.narrow(getattr(param, "output_dim", 0), rows[1], rows[2])

    def fused_weight(self, module_name: str, names: list[str], tensor: Callable[[str], torch.Tensor],
                     shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        """The whole `weight` of a linear module ([out, in]) from its checkpoint-named tensors (q, k and v
        stacked as vLLM fuses them); None unless they are exactly its rows."""
        weight = torch.empty(shape, dtype=dtype)
        covered = 0
        for name in names:
            rows = self.rows(name)
            if rows is None or rows[0] != f"{module_name}.weight":
                return None  # a bias, or a layout not known here: vLLM's reload takes the layer
            part = tensor(name)
            first, count = (0, shape[0]) if rows[1] is None else (rows[1], rows[2])
            if tuple(part.shape) != (count, shape[1]):
                return None
            weight[first:first + count] = part
            covered += count
        return weight if covered == shape[0] else None


def _claim(state: dict[str, Any]) -> tuple[str | None, int | None]:
    """The store and version the shadow holds, (None, None) for none; from here until the install
    the shadow is no longer what vLLM holds (version None), so an install that never comes leaves
    the next plan to rebuild in full."""
    held = (state["url"], state["version"]) if state["shadow"] else (None, None)
    state["version"] = None
    return held


def _decode(state: dict[str, Any], plan: dict[str, Any], held: tuple[str | None, int | None]) -> dict[str, Any]:
    """The plan's version computed in the shadow (at `held`) and checked: by its deltas when the
    shadow holds their base, else, or when they do not check out, rebuilt from the full version.
    What the install needs, or an answer with an `error` (vLLM untouched)."""
    core = codec_core()
    started = time.perf_counter()
    shadow: dict[str, np.ndarray] = state["shadow"]
    final = plan["final"]
    store = _Store(plan["url"])
    how, detail, changed = None, None, set()
    if plan.get("deltas") and held == (plan["url"], plan["have"]):
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
    elif held[1] is None or held[0] != plan["url"]:
        detail = "no version of this store loaded in the vLLM worker: rebuilt from the full version"
    else:
        detail = (f"the store has no delta chain from the vLLM worker's v{held[1]} to "
                  f"v{plan['version']}: rebuilt from the full version")
    if how is None:
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
    return {"plan": plan, "how": how, "detail": detail, "changed": changed, "bytes_read": store.bytes_read,
            "meta": {e["name"]: (e["dtype"], e["shape"]) for e in final},
            "seconds": {"decode": time.perf_counter() - started}}


class RolloutWeightExtension:
    """Mixed into vLLM's worker class; its methods are what `/collective_rpc` may call by name."""

    def _rollout_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_rollout_weights")
        if state is None:
            state = self.__dict__["_rollout_weights"] = {"url": None, "version": None, "shadow": {}, "meta": {},
                                                         "staging": None}
        return state

    def _rollout_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def rollout_apply_store(self, plan: str) -> dict[str, Any]:
        """Bring this worker's weights to the plan's version (a JSON string: see the module docstring),
        decode and all, in this call (the engine paused for all of it)."""
        state = self._rollout_state()
        try:
            parsed = json.loads(plan)
            decoded = self._rollout_prepare(state, parsed, _claim(state))
            return decoded if "error" in decoded else self._rollout_install(state, decoded)
        except Exception as exc:  # anything raised here would kill vLLM's engine
            log.exception("rollout_apply_store failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "version": state["version"]}

    def rollout_stage_store(self, plan: str) -> dict[str, Any]:
        """Start computing the plan's version in the extension's copy on a thread of its own, and
        answer at once: vLLM keeps generating on the weights it holds (a `collective_rpc` call runs in
        the worker's loop that also runs the model's steps, so a call that decoded here would stop
        generation for as long).
        `rollout_staged` says when it is done; `rollout_install_store` feeds it to vLLM, in the pause."""
        state = self._rollout_state()
        try:
            running = state.get("staging")
            if running is not None and running["thread"].is_alive():
                return {"ok": False, "error": f"v{running['version']} is still being staged; install it first"}
            parsed = json.loads(plan)
            staging: dict[str, Any] = {"version": parsed["version"], "result": None}
            held = _claim(state)

            def work() -> None:
                try:
                    staging["result"] = self._rollout_prepare(state, parsed, held)
                except Exception as exc:  # reported by rollout_staged / rollout_install_store
                    log.exception("staging v%s failed", parsed.get("version"))
                    staging["result"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "version": None}

            staging["thread"] = threading.Thread(target=work, name="rollout-stage", daemon=True)
            state["staging"] = staging
            staging["thread"].start()
            return {"ok": True, "version": parsed["version"]}
        except Exception as exc:  # anything raised here would kill vLLM's engine
            log.exception("rollout_stage_store failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "version": state["version"]}

    def rollout_staged(self) -> dict[str, Any]:
        """Whether the version `rollout_stage_store` started is computed and checked (`done`), and,
        once done, whether it can be installed (`ok`, else `error`). Never waits: it runs in the
        loop that runs vLLM's model steps."""
        staging = self._rollout_state().get("staging")
        if staging is None:
            return {"ok": False, "done": True, "error": "nothing is being staged"}
        result = staging["result"]
        if result is None:
            return {"ok": True, "done": False, "version": staging["version"]}
        if "error" in result:
            return {**result, "done": True}
        return {"ok": True, "done": True, "version": staging["version"], "how": result["how"],
                "seconds": result["seconds"]}

    def rollout_install_store(self, version: int) -> dict[str, Any]:
        """Feed vLLM the staged `version` (its changed layers) and read back what it keeps readable."""
        state = self._rollout_state()
        try:
            staging = state.get("staging")
            if staging is None or staging["version"] != version or staging["result"] is None:
                what = "nothing" if staging is None else f"v{staging['version']}"
                done = staging is not None and staging["result"] is not None
                return {"ok": False, "version": state["version"],
                        "error": f"v{version} is not staged here ({what} is{'' if done else ' still being'} staged)"}
            state["staging"] = None
            decoded = staging["result"]
            return decoded if "error" in decoded else self._rollout_install(state, decoded)
        except Exception as exc:  # anything raised here would kill vLLM's engine
            log.exception("rollout_install_store failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "version": state["version"]}

    def _rollout_prepare(self, state: dict[str, Any], plan: dict[str, Any],
                         held: tuple[str | None, int | None]) -> dict[str, Any]:
        """Everything before the pause: the version decoded and checked in the shadow, and the new
        kernel handles of its changed layers built and read back (`cpu_kernels`)."""
        decoded = _decode(state, plan, held)
        if "error" not in decoded:
            started = time.perf_counter()
            decoded["packed"] = self._rollout_pack(state["shadow"], decoded["meta"], decoded["changed"])
            decoded["seconds"]["pack"] = time.perf_counter() - started
        return decoded

    def _rollout_pack(self, shadow: dict[str, np.ndarray], meta: dict[str, tuple[str, list[int]]],
                      changed: set[str]) -> dict[str, cpu_kernels.Packed]:
        """A new kernel handle for each changed layer vLLM computes through one (its CPU build's
        linear layers), by module name; other layers are left to the install."""
        model = self._rollout_model()
        layout = _Layout(model)
        names_of: dict[str, list[str]] = {}
        for name in shadow:
            names_of.setdefault(layout.module_of(name), []).append(name)
        packed: dict[str, cpu_kernels.Packed] = {}
        for module_name in sorted({layout.module_of(name) for name in changed}):
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                continue
            handler = cpu_kernels.onednn_handler(module)
            if handler is None:
                continue
            weight = layout.fused_weight(module_name, names_of[module_name],
                                         lambda n: to_torch(shadow[n], *meta[n]), (handler.n, handler.k),
                                         module.weight.dtype)
            try:
                done = None if weight is None else cpu_kernels.pack(module, weight)
            except Exception:  # vLLM's reload takes this layer in the pause instead
                log.exception("packing %s's new weights failed", module_name)
                done = None
            if done is not None:
                packed[module_name] = done
        return packed

    def _rollout_install(self, state: dict[str, Any], decoded: dict[str, Any]) -> dict[str, Any]:
        """In the pause: the new kernel handles swapped in, the changed tensors vLLM keeps readable
        copied into place, any other changed layer fed to vLLM's in-place reload; then read back."""
        started = time.perf_counter()
        plan, final = decoded["plan"], decoded["plan"]["final"]
        state["meta"] = decoded["meta"]
        layout = _Layout(self._rollout_model())
        packed: dict[str, cpu_kernels.Packed] = decoded.pop("packed")
        for module_name, kernel in list(packed.items()):
            if cpu_kernels.onednn_handler(kernel.module) is kernel.old:
                kernel.swap()
            else:  # vLLM rebuilt the layer since it was packed (a reload): its reload takes the layer again
                del packed[module_name]
        copied, feed = 0, set()
        with torch.no_grad():
            for name in sorted(decoded["changed"]):
                dtype, shape = state["meta"][name]
                target = layout.read(name)
                if target is not None and tuple(target.shape) == tuple(shape) and target.dtype == torch_dtype(dtype):
                    target.copy_(to_torch(state["shadow"][name], dtype, shape).to(target.device))
                    copied += 1
                elif layout.module_of(name) not in packed:
                    feed.add(name)
        fed = self._rollout_feed(state, feed)
        state["url"], state["version"] = plan["url"], plan["version"]
        loaded = time.perf_counter()
        engine = self._rollout_engine_checksums(state)
        wrong = [e["name"] for e in final if engine.get(e["name"]) not in (None, e["xxh3"])]
        result = {"ok": not wrong, "version": plan["version"], "how": decoded["how"], "detail": decoded["detail"],
                  "bytes_read": decoded["bytes_read"], "tensors_changed": len(decoded["changed"]),
                  "layers_swapped": len(packed), "tensors_copied": copied, "tensors_fed": fed,
                  "checked_in_engine": sum(1 for v in engine.values() if v is not None),
                  "not_readable_in_engine": sum(1 for v in engine.values() if v is None),
                  "seconds": {**decoded["seconds"], "load": loaded - started,
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
        # A new dict, not a clear: a staging thread still running writes into the one it started with.
        state.update(url=None, version=None, meta={}, shadow={}, staging=None)
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

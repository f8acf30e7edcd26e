"""Applying a stored version (`pipeline.weights`) to an engine's tensors in place, checked bit for bit.

`apply_version(store, tensors, have, version)` takes a model's tensors by name (a `state_dict()`:
tied names share storage and are written once) from version `have` of the store to `version`:

- **delta**: when the store holds every delta from `have` to `version`, each changed tensor is
  rewritten in place (on the tensor's own memory when it is a CPU tensor of the stored dtype;
  else through a CPU copy of its bits in the stored dtype);
- **full**: otherwise (no `have`: a worker that joined late or loaded a checkpoint since; a
  missing delta), the latest full version at or before `version` and every delta after it.

Then every tensor's checksum (xxh3-128 of its bits in the stored dtype) is compared with the manifest's. A
delta that leaves any tensor different falls back to the full rebuild, and says so; a full
rebuild that still differs raises `WeightsMismatchError` after putting `have` back when the store
can rebuild it (the tensors are then exactly `have` again), so weights are exact or refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline.errors import WeightsMismatchError
from pipeline.weights.codec import CorruptDeltaError
from pipeline.weights.manifest import Manifest, TensorEntry
from pipeline.weights.store import StoreError, WeightStore, apply_entry, checksum
from pipeline.weights.torch_bits import dtype_name, from_words, torch_dtype, words_view

log = logging.getLogger(__name__)




@dataclass(frozen=True)
class Applied:
    """What a worker did to reach `version`: `how` ("delta" or "full"), the store bytes it read,
    and, for a full rebuild, why (`detail`)."""

    version: int
    how: Literal["delta", "full"]
    bytes_read: int
    tensors_changed: int
    detail: str | None = None


class _Target:
    """A model's tensors by name, each storage once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.owner: dict[tuple[int, int], str] = {}
        for name, tensor in self.tensors.items():
            self.owner.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), name)

    def storage_key(self, name: str) -> tuple[int, int]:
        tensor = self.tensors[name]
        return tensor.untyped_storage().data_ptr(), tensor.storage_offset()

    def check(self, manifest: Manifest, store: WeightStore, *, covers_all: bool) -> None:
        """Refuse, before writing anything, a version whose tensors this model does not have
        (names, sizes) or, for a rebuild, one that leaves a tensor of the model unwritten."""
        where = f"{store.url} v{manifest.version}"
        for entry in manifest.tensors:
            tensor = self.tensors.get(entry.name)
            if tensor is None:
                raise StoreError(f"{where}: tensor {entry.name} is not a tensor of the loaded model "
                                 f"(another model's weights?)")
            if tuple(tensor.shape) != tuple(entry.shape):
                raise StoreError(f"{where}: tensor {entry.name} has shape {entry.shape}, the loaded model's "
                                 f"{list(tensor.shape)}")
        if covers_all:
            written = {self.storage_key(e.name) for e in manifest.tensors}
            missing = sorted(n for n in self.tensors if self.storage_key(n) not in written)
            if missing:
                raise StoreError(f"{where}: {len(missing)} tensor(s) of the loaded model are not in the store "
                                 f"(e.g. {missing[0]}); it cannot rebuild this model")

    def words(self, entry: TensorEntry) -> tuple[np.ndarray, bool]:
        """The tensor's bits in the stored dtype, and whether they are its own memory."""
        tensor = self.tensors[entry.name]
        if tensor.device.type == "cpu" and dtype_name(tensor.dtype) == entry.dtype and tensor.is_contiguous():
            return words_view(tensor), True
        stored = tensor.detach().to("cpu", dtype=torch_dtype(entry.dtype), copy=True).contiguous()
        return words_view(stored), False

    def write(self, entry: TensorEntry, words: np.ndarray) -> None:
        tensor = self.tensors[entry.name]
        tensor.copy_(from_words(words, entry.dtype, entry.shape).to(tensor.device, tensor.dtype))

    def mismatched(self, manifest: Manifest) -> list[str]:
        bad = []
        for entry in manifest.tensors:
            words, _ = self.words(entry)
            if checksum(words) != entry.xxh3:
                bad.append(entry.name)
        return bad


def _apply_manifests(store: WeightStore, target: _Target, manifests: list[Manifest]) -> tuple[int, int]:
    """Apply each manifest's entries in order; (bytes read, tensors written)."""
    read = changed = 0
    with torch.no_grad():
        for manifest in manifests:
            done: set[tuple[int, int]] = set()
            for entry in manifest.tensors:
                key = target.storage_key(entry.name)
                if entry.encoding == "same" or key in done:
                    continue
                done.add(key)
                words, own = target.words(entry)
                try:
                    new = apply_entry(store, manifest.version, entry, words)
                except CorruptDeltaError as exc:
                    raise CorruptDeltaError(f"{store.url} v{manifest.version}: tensor {entry.name}: {exc}") from exc
                read += entry.length
                changed += 1
                if not own or new is not words:
                    target.write(entry, new)
    return read, changed


def apply_version(store: WeightStore, tensors: Mapping[str, torch.Tensor], have: int | None, version: int) -> Applied:
    """Bring `tensors` from store version `have` (None: not a version of this store) to `version`."""
    target = _Target(tensors)
    final = store.manifest(version)
    target.check(final, store, covers_all=False)
    detail: str | None = None
    deltas = store.deltas_between(have, version) if have is not None and have != version else None
    if deltas:
        try:
            read, changed = _apply_manifests(store, target, deltas)
            bad = target.mismatched(final)
        except CorruptDeltaError as exc:
            read, changed, bad = 0, 0, [str(exc)]
        if not bad:
            return Applied(version, "delta", read, changed)
        detail = (f"the delta from v{have} left {len(bad)} tensor(s) not bit-identical to the trainer's "
                  f"(e.g. {bad[0]}); rebuilt from the full version")
        log.warning("weights v%d from %s: %s", version, store.url, detail)
    elif have is None:
        detail = "no version of this store loaded: rebuilt from the full version"
    else:
        detail = f"the store has no delta chain from v{have} to v{version}: rebuilt from the full version"
    chain = store.chain(version)
    target.check(chain[0], store, covers_all=True)
    try:
        read, changed = _apply_manifests(store, target, chain)
        bad = target.mismatched(final)
    except CorruptDeltaError as exc:
        bad = [str(exc)]
    if bad:
        restored = _restore(store, target, have)
        raise WeightsMismatchError(
            f"{store.url} v{version}: after a full rebuild {len(bad)} tensor(s) are not bit-identical to the "
            f"trainer's (e.g. {bad[0]}): the store is corrupt; {restored}; push the weights again as a new "
            "full version (`--full`, or `delta=False`)")
    return Applied(version, "full", read, changed, detail)


def _restore(store: WeightStore, target: _Target, have: int | None) -> str:
    if have is None:
        return "the engine's weights are no longer the ones it served: this worker takes no job until a push loads"
    try:
        chain = store.chain(have)
        _apply_manifests(store, target, chain)
        if not target.mismatched(store.manifest(have)):
            return f"the engine is back at v{have}, bit for bit"
    except (StoreError, CorruptDeltaError) as exc:
        log.error("restoring v%d from %s failed: %s", have, store.url, exc)
    return f"v{have} could not be restored: this worker takes no job until a push loads"

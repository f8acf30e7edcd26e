"""Applying a stored version (`pipeline.weights`) to an engine's tensors, checked bit for bit.

Two ways, the same result:

- **staged** (`stage_version`, then `Staged.install()`): every new tensor is computed beside the
  engine's weights and its checksum checked there, while the engine keeps generating on the old
  ones; only then is the engine paused, and `install()` puts the checked tensors in: a swap of
  the parameter's storage for a tensor that changed in most of its elements, the changed elements
  alone for one that changed in few (`SPARSE_INSTALL`), a copy where neither fits (another device
  or dtype). It costs memory: the staged tensors (a whole copy of each tensor changed in most of
  its elements, indices and values of the others) until the install. Not bounded by buckets,
  since the install must be one step between two decode steps;
- **in place** (`apply_version`): each changed tensor is rewritten on its own memory (when it is
  a CPU tensor of the stored dtype; else through a CPU copy of its bits), then every tensor's
  checksum compared: no staged copy, but the engine stays paused for all of it.

Either reaches `version` from the version `have` the engine serves:

- **delta**: when the store holds every delta from `have` to `version`;
- **full**: otherwise (no `have`: a worker that joined late or loaded a checkpoint since; a
  missing delta), the latest full version at or before `version` and every delta after it.

Each tensor's checksum (xxh3-128 of its bits in the stored dtype) is compared with the
manifest's. A delta that leaves any tensor different falls back to the full rebuild, and says so;
a full rebuild that still differs raises `WeightsMismatchError`: staged, before anything was
installed (the engine is untouched); in place, after putting `have` back when the store can
rebuild it. So weights are exact or refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from pipeline.core.errors import WeightsMismatchError
from pipeline.core.weights.codec import CorruptDeltaError
from pipeline.core.weights.manifest import Manifest, TensorEntry
from pipeline.core.weights.store import StoreError, WeightStore, apply_entry, checksum
from pipeline.core.weights.torch_bits import dtype_name, from_words, torch_dtype, words_view

log = logging.getLogger(__name__)

# A staged tensor whose changed elements are at most 1/SPARSE_INSTALL of it is installed element
# by element (an indexed write costs several times a copy per element; bf16 steps change ~1-4 %).
SPARSE_INSTALL = 8
# One way of reaching a version: (manifests, the final one, whether from the engine's bits) -> (result, bad).
Attempt = Callable[[list[Manifest], Manifest, bool], tuple[Any, list[str]]]


@dataclass(frozen=True)
class Applied:
    """What a worker did to reach `version`: `how` ("delta" or "full"), the store bytes it read,
    and, for a full rebuild, why (`detail`)."""

    version: int
    how: Literal["delta", "full"]
    bytes_read: int
    tensors_changed: int
    detail: str | None = None


@dataclass(frozen=True)
class _Change:
    """One tensor's new bits, staged: the whole tensor's words, or (`index`) the changed elements'."""

    entry: TensorEntry
    words: np.ndarray
    index: np.ndarray | None = None


class _Target:
    """A model's tensors by name, each storage once; `parameters` (the model's `named_parameters`,
    tied names included) lets an install swap a parameter's storage instead of copying into it."""

    def __init__(self, tensors: Mapping[str, torch.Tensor],
                 parameters: Mapping[str, torch.nn.Parameter] | None = None) -> None:
        self.tensors = dict(tensors)
        self.parameters = dict(parameters or {})

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

    def install(self, change: _Change) -> None:
        """Put a staged tensor in: its changed elements, a swap of the parameter's storage, or a copy."""
        entry = change.entry
        tensor = self.tensors[entry.name]
        if change.index is not None:
            values = from_words(change.words, entry.dtype, (change.index.size,)).to(tensor.device, tensor.dtype)
            tensor.view(-1)[torch.from_numpy(change.index).to(tensor.device)] = values
            return
        new = from_words(change.words, entry.dtype, entry.shape)
        parameter = self.parameters.get(entry.name)
        if parameter is not None and parameter.device == new.device and parameter.dtype == new.dtype:
            parameter.data = new  # tied names share the Parameter: each sees the new storage
        else:
            tensor.copy_(new.to(tensor.device, tensor.dtype))

    def mismatched(self, manifest: Manifest) -> list[str]:
        bad = []
        for entry in manifest.tensors:
            words, _ = self.words(entry)
            if checksum(words) != entry.xxh3:
                bad.append(entry.name)
        return bad


# -- staged -----------------------------------------------------------------------------------


@dataclass
class Staged:
    """A version computed and checked beside the engine's weights; `install()` puts it in."""

    applied: Applied
    changes: list[_Change]
    target: _Target

    @property
    def staged_bytes(self) -> int:
        """The memory the staged tensors hold until the install."""
        return sum(c.words.nbytes + (0 if c.index is None else c.index.nbytes) for c in self.changes)

    def install(self) -> Applied:
        with torch.no_grad():
            for change in self.changes:
                self.target.install(change)
        self.changes = []
        return self.applied


def _stage_manifests(store: WeightStore, target: _Target, manifests: list[Manifest], final: Manifest, *,
                     from_current: bool) -> tuple[list[_Change], int, list[str]]:
    """Each tensor of `final` computed through `manifests` (from the engine's bits when
    `from_current`, a delta chain; else from nothing, a full chain) into staging and checked;
    (the changed tensors, bytes read, the names whose checksum differs)."""
    entries = [{e.name: e for e in m.tensors} for m in manifests]
    changes: list[_Change] = []
    bad: list[str] = []
    read = 0
    done: set[tuple[int, int]] = set()
    for final_entry in final.tensors:
        key = target.storage_key(final_entry.name)
        if key in done:
            continue
        done.add(key)
        current, _ = target.words(final_entry)
        words: np.ndarray | None = current if from_current else None
        for manifest, by_name in zip(manifests, entries, strict=True):
            entry = by_name.get(final_entry.name)
            if entry is None:
                words = None
                continue
            if entry.encoding == "same":
                continue
            if words is current:
                words = current.copy()  # never the engine's own memory: it keeps generating on it
            try:
                words = apply_entry(store, manifest.version, entry, words)
            except CorruptDeltaError as exc:
                raise CorruptDeltaError(f"{store.url} v{manifest.version}: tensor {entry.name}: {exc}") from exc
            read += entry.length
        if words is None or checksum(words) != final_entry.xxh3:
            bad.append(final_entry.name)
        elif words is not current:
            changes.append(_staged_change(final_entry, current, words, target.tensors[final_entry.name]))
    return changes, read, bad


def _staged_change(entry: TensorEntry, current: np.ndarray, new: np.ndarray, tensor: torch.Tensor) -> _Change:
    """The whole new tensor, or only its changed elements when they are few."""
    if tensor.is_contiguous() and current.dtype == new.dtype and current.size == new.size:
        index = np.flatnonzero(current != new)
        if index.size * SPARSE_INSTALL <= new.size:
            return _Change(entry, new[index], index)
    return _Change(entry, new)


def stage_version(store: WeightStore, tensors: Mapping[str, torch.Tensor], have: int | None, version: int, *,
                  parameters: Mapping[str, torch.nn.Parameter] | None = None) -> Staged:
    """`version` computed beside `tensors` (at store version `have`; None: not a version of this
    store) and checked, nothing of the engine written; `Staged.install()` puts it in."""
    target = _Target(tensors, parameters)

    def attempt(manifests: list[Manifest], final: Manifest, from_current: bool) -> tuple[Any, list[str]]:
        changes, read, bad = _stage_manifests(store, target, manifests, final, from_current=from_current)
        return (changes, read), bad

    how, result, detail, bad = _reach(store, target, have, version, attempt)
    if bad:
        raise WeightsMismatchError(
            f"{store.url} v{version}: rebuilt from the full version, {len(bad)} tensor(s) are not bit-identical to "
            f"the trainer's (e.g. {bad[0]}): the store is corrupt; nothing was installed, the engine's weights are "
            "unchanged; push the weights again as a new full version (`--full`, or `delta=False`)")
    changes, read = result
    return Staged(Applied(version, how, read, len(changes), detail), changes, target)


def _reach(store: WeightStore, target: _Target, have: int | None, version: int,
           attempt: Attempt) -> tuple[Literal["delta", "full"], Any, str | None, list[str]]:
    """Reach `version` by the deltas from `have` if the store has them and they check out, else
    from the full version: `attempt(manifests, final, from_current)` -> (result, tensors that differ);
    returns how, the result, why a full rebuild, and what still differs after it."""
    final = store.manifest(version)
    target.check(final, store, covers_all=False)
    deltas = store.deltas_between(have, version) if have is not None and have != version else None
    if deltas:
        try:
            result, bad = attempt(deltas, final, True)
        except CorruptDeltaError as exc:
            result, bad = None, [str(exc)]
        if not bad:
            return "delta", result, None, []
        detail = _delta_failed(store, version, have, bad)
    else:
        detail = _no_delta(have, version)
    chain = store.chain(version)
    target.check(chain[0], store, covers_all=True)
    try:
        result, bad = attempt(chain, final, False)
    except CorruptDeltaError as exc:
        result, bad = None, [str(exc)]
    return "full", result, detail, bad


def _delta_failed(store: WeightStore, version: int, have: int | None, bad: list[str]) -> str:
    detail = (f"the delta from v{have} left {len(bad)} tensor(s) not bit-identical to the trainer's "
              f"(e.g. {bad[0]}); rebuilt from the full version")
    log.warning("weights v%d from %s: %s", version, store.url, detail)
    return detail


def _no_delta(have: int | None, version: int) -> str:
    if have is None:
        return "no version of this store loaded: rebuilt from the full version"
    return f"the store has no delta chain from v{have} to v{version}: rebuilt from the full version"


# -- in place ---------------------------------------------------------------------------------


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
    """Bring `tensors` from store version `have` (None: not a version of this store) to `version`, in place."""
    target = _Target(tensors)

    def attempt(manifests: list[Manifest], final: Manifest, from_current: bool) -> tuple[Any, list[str]]:
        read_changed = _apply_manifests(store, target, manifests)
        return read_changed, target.mismatched(final)

    how, result, detail, bad = _reach(store, target, have, version, attempt)
    if bad:
        restored = _restore(store, target, have)
        raise WeightsMismatchError(
            f"{store.url} v{version}: after a full rebuild {len(bad)} tensor(s) are not bit-identical to the "
            f"trainer's (e.g. {bad[0]}): the store is corrupt; {restored}; push the weights again as a new "
            "full version (`--full`, or `delta=False`)")
    read, changed = result
    return Applied(version, how, read, changed, detail)


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

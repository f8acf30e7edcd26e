"""The LoRA adapters an engine keeps resident: loaded from their store on demand, least recently
used evicted past the worker's `--max-adapters`.

A job's requests name their adapter pinned to a version (`schemas.adapters.pinned`, set by
`workers.jobs.adapters`, which also tells the cache that version's record). The engine calls
`ensure` with the pinned adapters of the batch it is about to run, on its own thread between
batches: each missing one is read from its store (every tensor's checksum checked; `stage` does
that ahead, when a push is acknowledged) and handed to
the engine's `load`; past the capacity the least recently used ones the batch does not need are
handed to `unload`. A batch needing more adapters than the capacity keeps them all while it runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from pipeline.core.errors import PipelineError
from pipeline.core.weights.safetensors_io import TensorBits
from pipeline.core.weights.store import WeightStore, checksum
from schemas.adapters import AdapterRecord, pinned, split_pinned
from workers.errors import UnsupportedRequestError

DEFAULT_MAX_ADAPTERS = 8
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


Load = Callable[[str, AdapterRecord, list[TensorBits]], None]


class AdapterCache:
    """Pinned adapter key → record of every version a job named; the resident ones in LRU order."""

    def __init__(self, load: Load, unload: Callable[[str], None], capacity: int = DEFAULT_MAX_ADAPTERS) -> None:
        self.capacity = max(1, capacity)
        self._load = load
        self._unload = unload
        self._records: dict[str, AdapterRecord] = {}
        self._lock = threading.Lock()
        self.resident: OrderedDict[str, None] = OrderedDict()
        self._staged: dict[str, list[TensorBits]] = {}  # read and checked ahead of their first batch
        self.loads = 0
        self.evictions = 0

    def note(self, record: AdapterRecord) -> str:
        """Remember `record` (a job will name it); its pinned key."""
        key = pinned(record.name, record.version)
        with self._lock:
            self._records[key] = record
        return key

    def ensure(self, keys: Iterable[str]) -> None:
        """Every adapter of `keys` resident (loaded from its store if not), most recently used; then
        evict past the capacity, never one of `keys`. `UnsupportedRequestError` if one cannot load."""
        wanted = list(dict.fromkeys(k for k in keys if k != BASE))
        for key in wanted:
            with self._lock:
                if key in self.resident:
                    self.resident.move_to_end(key)
                    continue
                record = self._records.get(key)
                staged = self._staged.pop(key, None)
            if record is None:
                raise UnsupportedRequestError(f"adapter {key}: this worker was never told where it is stored")
            tensors = staged if staged is not None else read_version(record)
            try:
                self._load(key, record, tensors)
            except Exception as exc:  # peft's own checks: the adapter does not fit this engine's model
                raise UnsupportedRequestError(f"adapter {key} does not load on this worker: {exc}") from exc
            with self._lock:
                self.resident[key] = None
            self.loads += 1
        for key in [k for k in self.held() if k not in wanted][: max(0, len(self.resident) - self.capacity)]:
            self._unload(key)
            with self._lock:
                del self.resident[key]
            self.evictions += 1

    def stage(self, record: AdapterRecord) -> int:
        """Read and check the adapter version `record` names ahead of the first batch that needs it (an
        adapter push's acknowledgement: `workers.process.adapter_follower`), so that batch's load
        reads nothing; any other staged version of the adapter is dropped. The bytes read (0: it is
        resident already). `UnsupportedRequestError` if it cannot be read or fails a checksum."""
        key = self.note(record)
        with self._lock:
            if key in self.resident or key in self._staged:
                return 0
        tensors = read_version(record)
        with self._lock:
            for other in [k for k in self._staged if split_pinned(k)[0] == record.name]:
                del self._staged[other]
            self._staged[key] = tensors
        return sum(t.words.nbytes for t in tensors)

    def held(self) -> list[str]:
        """The resident adapters' keys, least recently used first (safe from any thread)."""
        with self._lock:
            return list(self.resident)

    def forget(self, key: str) -> None:
        """Adapter `key` is no longer resident (its server lost it): loaded again when next needed."""
        with self._lock:
            self.resident.pop(key, None)

    def clear(self) -> None:
        """Forget what is resident (the engine dropped every adapter: new base weights)."""
        with self._lock:
            self.resident.clear()


def read_version(record: AdapterRecord) -> list[TensorBits]:
    """Every tensor of the adapter version `record` names, its checksum checked."""
    where = f"adapter {record.name!r} v{record.version} ({record.url})"
    try:
        store = WeightStore(record.url)
        entries = store.manifest(record.version).tensors
        tensors = [store.tensor(record.version, entry.name) for entry in entries]
    except (PipelineError, OSError) as exc:
        raise UnsupportedRequestError(f"{where} cannot be read here: {exc}") from exc
    for entry, bits in zip(entries, tensors, strict=True):
        if bits is None or checksum(bits.words) != entry.xxh3:
            raise UnsupportedRequestError(f"{where}: tensor {entry.name} does not match its checksum")
    return [bits for bits in tensors if bits is not None]


def serves_adapters(engine: object) -> bool:
    """Whether an engine serves LoRA adapters (it has an `adapters` cache)."""
    return isinstance(getattr(engine, "adapters", None), AdapterCache)


def resident_adapters(engine: object) -> list[str]:
    """The adapter versions resident on an engine (none where it serves no adapters)."""
    return engine.adapters.held() if serves_adapters(engine) else []  # type: ignore[attr-defined]

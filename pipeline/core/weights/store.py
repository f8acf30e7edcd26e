"""A versioned weight store at an fsspec URL: full versions, deltas between them, rebuilt tensor by tensor.

Layout (`URL/v00000003/...`, one directory per version):

- a **full** version: `full-00000.safetensors`, `full-00001.safetensors`, ... (buckets of at
  most `bucket_bytes`, so neither writer nor reader holds more than a bucket beyond the model);
- a **delta** version: `delta-00000.bin`, ... — each tensor's change against the version before
  (`pipeline.core.weights.codec`), concatenated in buckets;
- `manifest.json` (`pipeline.core.weights.manifest`), written last: where each tensor's bytes are,
  how they are encoded and the checksum of the tensor's bits at this version. A directory without
  one is a push that did not finish; readers ignore it and the next write of that version
  replaces it.

A version is rebuilt from the latest full version at or before it plus every delta after that
(`chain`). The default store of a pool is `file://<PIPELINE_HOME>/weights/<pool>`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from pipeline.core import settings
from pipeline.core.errors import StoreError
from pipeline.core.storage import url_to_fs
from pipeline.core.weights import codec
from pipeline.core.weights.codec_core import checksum as checksum  # the store's checksum, re-exported
from pipeline.core.weights.manifest import MANIFEST, Manifest, ManifestError, TensorEntry, parse_manifest
from pipeline.core.weights.safetensors_io import TensorBits, encode_file, read_range

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024




def default_url(pool: str) -> str:
    """Where a pool's store lives unless a push names one."""
    return f"file://{settings.home() / 'weights' / pool}"


def describe(url: str) -> dict[str, object]:
    """What a store holds, for `pipeline weights status`: each version's kind and stored bytes."""
    store = WeightStore(url)
    try:
        versions = [{"version": v, "kind": store.manifest(v).kind, "stored_bytes": store.manifest(v).stored_bytes}
                    for v in store.versions()]
    except (StoreError, OSError) as exc:
        return {"url": url, "versions": [], "error": f"unreadable here: {exc}"}
    return {"url": url, "versions": versions}


def version_dir(version: int) -> str:
    return f"v{version:08d}"


class WeightStore:
    """The store at `url` (created on first write)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url)
        self._manifests: dict[int, Manifest] = {}

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    # -- reading ---------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Every complete version (with a manifest), oldest first."""
        if not self.fs.exists(self.root):
            return []
        found = []
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("v") and name[1:].isdigit() and self.fs.exists(f"{path.rstrip('/')}/{MANIFEST}"):
                found.append(int(name[1:]))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        path = self._path(version_dir(version), MANIFEST)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise StoreError(f"{self.url}: no version {version} (no {version_dir(version)}/{MANIFEST}); "
                             f"the store holds {self.versions() or 'nothing'}") from None
        try:
            manifest = parse_manifest(raw, f"{self.url}/{version_dir(version)}/{MANIFEST}")
        except ManifestError as exc:
            raise StoreError(str(exc)) from exc
        if manifest.version != version:
            raise StoreError(f"{self.url}/{version_dir(version)}/{MANIFEST}: names version {manifest.version}")
        self._manifests[version] = manifest
        return manifest

    def chain(self, version: int) -> list[Manifest]:
        """The manifests that rebuild `version`: its full version, then each delta up to it."""
        manifests = [self.manifest(version)]
        while manifests[0].kind == "delta":
            base = manifests[0].base
            assert base is not None
            try:
                manifests.insert(0, self.manifest(base))
            except StoreError as exc:
                raise StoreError(f"{self.url}: version {version} cannot be rebuilt: {exc}") from exc
        return manifests

    def deltas_between(self, have: int, version: int) -> list[Manifest] | None:
        """The deltas that take `have` to `version`, oldest first; None when they are not all there."""
        manifests: list[Manifest] = []
        current = version
        while current != have:
            try:
                manifest = self.manifest(current)
            except StoreError:
                return None
            if manifest.base is None or manifest.base < have:
                return None
            if manifest.kind == "full":  # a full version carrying its delta: that delta is the step
                if manifest.delta is None:
                    return None
                manifest = manifest.model_copy(update={"kind": "delta", "tensors": manifest.delta, "delta": None})
            manifests.insert(0, manifest)
            current = manifest.base
        return manifests

    def read_blob(self, version: int, entry: TensorEntry) -> bytes:
        if entry.file is None or entry.length == 0:
            return b""
        return read_range(self.fs, self._path(version_dir(version), entry.file), entry.offset, entry.length)

    def tensor(self, version: int, name: str) -> TensorBits | None:
        """One tensor's bits at `version`, rebuilt from its chain; None if that version has no such tensor."""
        chain = self.chain(version)
        entries = [{t.name: t for t in m.tensors}.get(name) for m in chain]
        if entries[-1] is None:
            return None
        words: np.ndarray | None = None
        for manifest, entry in zip(chain, entries, strict=True):
            if entry is None:
                words = None
                continue
            words = apply_entry(self, manifest.version, entry, words)
        assert words is not None and entries[-1] is not None
        final = entries[-1]
        return TensorBits(name, final.dtype, tuple(final.shape), words)

    # -- writing ---------------------------------------------------------------------------

    def writer(self, version: int, kind: str, base: int | None, full: int,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> VersionWriter:
        if version in self.versions():
            raise StoreError(f"{self.url}: version {version} is already stored; push a newer version")
        directory = self._path(version_dir(version))
        if self.fs.exists(directory):  # a push that did not finish
            self.fs.rm(directory, recursive=True)
        self.fs.makedirs(directory, exist_ok=True)
        return VersionWriter(self, version, kind, base, full, bucket_bytes)

    def prune(self, keep_from: int) -> list[int]:
        """Delete the versions no rebuild of `keep_from` or later needs (those before the full
        version `keep_from`'s chain starts from); returns the versions deleted."""
        start = self.chain(keep_from)[0].version
        gone = [v for v in self.versions() if v < start]
        for version in gone:
            self.remove(version)
        return gone

    def remove(self, version: int) -> None:
        """Delete one version (the manifest first: half deleted, it is an unfinished one, never a broken one)."""
        self.fs.rm(self._path(version_dir(version), MANIFEST))
        self.fs.rm(self._path(version_dir(version)), recursive=True)
        self._manifests.pop(version, None)

    def size_bytes(self) -> dict[int, int]:
        """Each complete version's stored tensor bytes."""
        return {v: self.manifest(v).stored_bytes for v in self.versions()}


def apply_entry(store: WeightStore, version: int, entry: TensorEntry, words: np.ndarray | None) -> np.ndarray:
    """A tensor's bits at `version` from its bits before (`words`, rewritten in place when it can be)."""
    word = codec.word_type(entry.dtype)
    blob = store.read_blob(version, entry)
    if entry.encoding == "plain":
        return np.frombuffer(blob, word).copy()
    if words is None or words.size != entry.elements or words.dtype != np.dtype(word):
        if entry.encoding != "raw":
            raise StoreError(f"{store.url}: version {version}: tensor {entry.name} is a {entry.encoding} delta "
                             "of a tensor the version before does not have with that dtype and shape")
        words = np.empty(entry.elements, word)
    codec.apply(entry.encoding, blob, words)
    return words


@dataclass
class VersionWriter:
    """Adds one version's tensors bucket by bucket; `commit()` writes the manifest."""

    store: WeightStore
    version: int
    kind: str
    base: int | None
    full: int
    bucket_bytes: int
    entries: list[TensorEntry] = field(default_factory=list)
    _pending: list[tuple[TensorBits, str, bytes]] = field(default_factory=list)
    _pending_bytes: int = 0
    _buckets: int = 0

    def add(self, tensor: TensorBits, encoding: str, blob: bytes, xxh3: str) -> None:
        if encoding == "same":
            self.entries.append(TensorEntry(name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape),
                                            xxh3=xxh3, encoding="same"))
            return
        self._pending.append((tensor, xxh3, blob))
        self._pending_bytes += tensor.words.nbytes if encoding == "plain" else len(blob)
        self.entries.append(TensorEntry(name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape),
                                        xxh3=xxh3, encoding=encoding))  # type: ignore[arg-type]
        if self._pending_bytes >= self.bucket_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        name = f"{'full' if self.kind == 'full' else 'delta'}-{self._buckets:05d}"
        self._buckets += 1
        if self.kind == "full":
            name += ".safetensors"
            data, spans = encode_file([tensor for tensor, _, _ in pending])
        else:
            name += ".bin"
            spans, position, parts = {}, 0, []
            for tensor, _, blob in pending:
                spans[tensor.name] = (position, len(blob))
                parts.append(blob)
                position += len(blob)
            data = b"".join(parts)
        self.store.fs.pipe_file(self.store._path(version_dir(self.version), name), data)
        placed = {tensor.name for tensor, _, _ in pending}
        self.entries = [e.model_copy(update={"file": name, "offset": spans[e.name][0], "length": spans[e.name][1]})
                        if e.name in placed and e.file is None else e for e in self.entries]

    def commit(self, delta: VersionWriter | None = None) -> Manifest:
        """Write the manifest (with `delta`'s entries: a full version carrying its delta)."""
        self._flush()
        if delta is not None:
            delta._flush()
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise StoreError(f"{self.store.url}: version {self.version}: tensor {duplicate} given twice")
        manifest = Manifest(version=self.version, kind=self.kind, base=self.base,  # type: ignore[arg-type]
                            full=self.full, tensors=self.entries, delta=None if delta is None else delta.entries)
        directory = self.store._path(version_dir(self.version))
        self.store.fs.pipe_file(f"{directory}/{MANIFEST}.tmp", manifest.model_dump_json().encode())
        self.store.fs.mv(f"{directory}/{MANIFEST}.tmp", f"{directory}/{MANIFEST}")
        self.store._manifests[self.version] = manifest
        return manifest


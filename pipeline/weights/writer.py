"""Writing the next version of a weight store from tensors given one at a time.

The first version, one pushed with `delta=False`, and every `full_every`-th after a full one
are written in full (the latter carrying their delta too, for the workers serving the version
before); the others as deltas against the latest stored version, whose tensors are
rebuilt from the store one at a time (so the writer holds one tensor of each version, never two
models). Every entry carries the checksum (xxh3-128) of the tensor's bits at the new version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.core.weights import codec
from pipeline.core.weights.manifest import Manifest
from pipeline.core.weights.safetensors_io import TensorBits
from pipeline.core.weights.store import DEFAULT_BUCKET_BYTES, StoreError, VersionWriter, WeightStore, checksum

DEFAULT_FULL_EVERY = 10


@dataclass(frozen=True)
class Written:
    """One stored version: its manifest, the bytes it added and the bytes of the model it encodes."""

    manifest: Manifest
    stored_bytes: int
    model_bytes: int


def write_version(
    store: WeightStore,
    tensors: Iterable[TensorBits],
    version: int,
    *,
    delta: bool = True,
    full_every: int = DEFAULT_FULL_EVERY,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Written:
    """Store `tensors` as `version` (newer than every stored one): a delta when `delta` and the
    chain since the last full version is shorter than `full_every`, else in full."""
    if full_every < 1:
        raise StoreError(f"full_every must be >= 1, got {full_every}")
    latest = store.latest()
    if latest is not None and version <= latest:
        raise StoreError(f"{store.url}: version {version} is not newer than the stored version {latest}; "
                         "push a newer version (or another store)")
    as_delta = delta and latest is not None and len(store.chain(latest)) < full_every
    # A full version every `full_every` also carries its delta, for the workers serving `latest`.
    with_delta = delta and latest is not None and not as_delta
    carried = None
    if as_delta:
        assert latest is not None
        full = store.chain(latest)[0].version
        out = store.writer(version, "delta", latest, full, bucket_bytes)
    else:
        out = store.writer(version, "full", latest if with_delta else None, version, bucket_bytes)
        if with_delta:
            carried = VersionWriter(store, version, "delta", latest, version, bucket_bytes)
    for tensor in tensors:
        words = tensor.words.reshape(-1)
        if words.dtype != codec.word_type(tensor.dtype):
            raise StoreError(f"tensor {tensor.name}: bits of {words.dtype}, not the {tensor.dtype} word")
        bits = TensorBits(tensor.name, tensor.dtype, tuple(tensor.shape), words)
        xxh3 = checksum(words)
        if as_delta or with_delta:
            before = store.tensor(latest, tensor.name)  # type: ignore[arg-type]
            same_kind = before is not None and before.dtype == bits.dtype and before.shape == bits.shape
            encoding, blob = codec.encode(before.words if same_kind else None, words)  # type: ignore[union-attr]
            (out if as_delta else carried).add(bits, encoding, blob, xxh3)  # type: ignore[union-attr]
        if not as_delta:
            out.add(bits, "plain", b"", xxh3)
    manifest = out.commit(carried)
    return Written(manifest, manifest.stored_bytes, manifest.model_bytes)

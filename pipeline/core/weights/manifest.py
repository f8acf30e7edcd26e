"""The record of one stored weight version (`manifest.json`, written last: a version without one
is incomplete and invisible), validated when read like every record a worker trusts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from pipeline.core.errors import ManifestError
from pipeline.core.weights.codec import WORDS, Encoding

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
Kind = Literal["full", "delta"]


class TensorEntry(BaseModel):
    """One tensor of a version: where its bytes are and the checksum of its resulting bits."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    name: Annotated[StrictStr, Field(min_length=1, max_length=1024)]
    dtype: StrictStr
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    # xxh3-128 of the tensor's raw little-endian bits at this version (after applying, for a delta).
    xxh3: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{32}$")]
    # `plain`: the bits as they are, in a safetensors file (full versions); else a codec encoding (deltas).
    encoding: Literal["plain"] | Encoding
    file: Annotated[StrictStr, Field(pattern=r"^[a-z0-9.-]{1,64}$")] | None = None
    offset: Annotated[StrictInt, Field(ge=0)] = 0
    length: Annotated[StrictInt, Field(ge=0)] = 0

    @property
    def elements(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        import numpy as np

        return self.elements * np.dtype(WORDS[self.dtype]).itemsize


class Manifest(BaseModel):
    """A full version (every tensor's bits) or a delta against `base` (the version before it)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    version: Annotated[StrictInt, Field(ge=0)]
    kind: Kind
    base: Annotated[StrictInt, Field(ge=0)] | None = None
    # The full version this one's chain starts from (itself for a full version).
    full: Annotated[StrictInt, Field(ge=0)]
    tensors: list[TensorEntry]
    # A full version written after deltas (every `full_every`) also carries its delta against
    # `base`: workers serving `base` apply that; only a rebuild reads the full bits.
    delta: list[TensorEntry] | None = None

    @property
    def stored_bytes(self) -> int:
        """Bytes of tensor data this version adds to the store (its delta's too, if it carries one)."""
        return sum(t.length for t in [*self.tensors, *(self.delta or [])])

    @property
    def model_bytes(self) -> int:
        """Bytes of the model at this version (every tensor's raw bits)."""
        return sum(t.nbytes for t in self.tensors)




def parse_manifest(raw: bytes, where: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(raw)} bytes, over the limit of {MAX_MANIFEST_BYTES}")
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<record>"
        raise ManifestError(f"{where}: {field}: {first['msg']}") from exc
    for tensor in [*manifest.tensors, *(manifest.delta or [])]:
        if tensor.dtype not in WORDS:
            raise ManifestError(f"{where}: tensor {tensor.name}: dtype {tensor.dtype!r} is not a safetensors dtype")
        if tensor.encoding != "same" and tensor.file is None:
            raise ManifestError(f"{where}: tensor {tensor.name}: {tensor.encoding} data without a file")
        # Bounds what a reader allocates: plain bits are the tensor's size, an encoding at most about twice it.
        limit = tensor.nbytes if tensor.encoding == "plain" else 2 * tensor.nbytes + 4096
        if tensor.length > limit or (tensor.encoding == "plain" and tensor.length != limit):
            raise ManifestError(f"{where}: tensor {tensor.name}: {tensor.length} bytes of {tensor.encoding} data for "
                                f"a {tensor.dtype} tensor of shape {tensor.shape} ({tensor.nbytes} bytes)")
    if (manifest.kind == "delta" or manifest.delta is not None) and (
            manifest.base is None or manifest.base >= manifest.version):
        raise ManifestError(f"{where}: a delta's base must be an older version, got {manifest.base}")
    if manifest.kind == "full" and manifest.base is not None and manifest.delta is None:
        raise ManifestError(f"{where}: a full version names a base ({manifest.base}) but carries no delta")
    return manifest

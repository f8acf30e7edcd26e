"""The control channel's records: the desired state workers converge to, their acks, and signing.

When a shared secret is configured, every record is stored inside a `Signed` envelope: the
record's JSON as `body` plus an HMAC-SHA256 over a purpose string and that body. The purpose
binds a signature to where the record belongs (`desired-state`; `ack:<version>:<worker>`, and
`adapter-ack:<name>:<version>:<worker>` for an adapter's; pools other than `default` add their
name), so a signed ack cannot be replayed as another worker's, another version's, another
adapter's or another pool's. Readers holding
the secret refuse unsigned and forged records with a located `ControlMessageError`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from schemas.adapters import AdapterName
from schemas.worker_info import DEFAULT_POOL

MAX_RECORD_BYTES = 64 * 1024
DESIRED_STATE_PURPOSE = "desired-state"

# How a worker swaps weights with samples in flight: `drain` lets every sample finish on the old
# weights first; `partial` stops them at the next step, loads, and continues them on the new ones.
SwapMode = Literal["drain", "partial"]
SWAP_MODES: tuple[SwapMode, ...] = ("drain", "partial")

# Where pushed weights are: a checkpoint directory (`weight_path`), or a versioned weight store
# (`pipeline.core.weights.store`) whose URL is `weight_path`, read as deltas where the worker can.
WeightSource = Literal["checkpoint", "store"]
# How a worker reached a pushed version: reloaded a checkpoint, applied deltas in place, or
# rebuilt it from the store's full version (and deltas after it).
Applied = Literal["checkpoint", "delta", "full"]


class DesiredState(BaseModel):
    """What every worker should be doing; `generation` grows by one on every change."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    generation: Annotated[StrictInt, Field(ge=0)] = 0
    paused: StrictBool = False
    weight_version: Annotated[StrictInt, Field(ge=0)] = 0
    # None: the weights the worker was started with.
    weight_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)] | None = None
    # How the push of `weight_version` swaps: see `SwapMode`.
    swap_mode: SwapMode = "drain"
    # What `weight_path` names: see `WeightSource`.
    weight_source: WeightSource = "checkpoint"
    # LoRA adapter name -> the newest version pushed with acknowledgements (`pipeline.weights.adapter_push`):
    # each worker serving adapters reads and checks that version (or a newer one) and acknowledges it.
    adapters: dict[AdapterName, Annotated[StrictInt, Field(ge=1)]] = {}
    # How the push of each adapter's version in `adapters` swaps (`SwapMode`; absent: "drain"). An
    # adapter push never pauses: with "drain" jobs in flight finish on the version they pinned; with
    # "partial" a worker stops the samples in flight on an older version of the adapter and continues
    # them on this one, each token keeping the adapter version that generated it.
    adapter_swap_modes: dict[AdapterName, SwapMode] = {}


class WeightAck(BaseModel):
    """A worker's answer to a weight push: loaded (`ok`) or not, how long it took, why not."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    worker: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    version: Annotated[StrictInt, Field(ge=0)]
    ok: StrictBool
    seconds: Annotated[StrictFloat, Field(ge=0)]  # the engine's pause: the part of the load it stopped for
    error: Annotated[StrictStr, Field(max_length=8192)] | None = None
    # Reading and staging the weights before that pause, while the engine generated on.
    prepare_seconds: Annotated[StrictFloat, Field(ge=0)] = 0.0
    # How the worker swapped: "drain" when asked for it, or when its engine cannot stop samples.
    mode: SwapMode = "drain"
    # How it loaded (`Applied`), the weight-store bytes it read, and why a store push was rebuilt in full.
    applied: Applied = "checkpoint"
    bytes_read: Annotated[StrictInt, Field(ge=0)] = 0
    detail: Annotated[StrictStr, Field(max_length=8192)] | None = None
    # The LoRA adapter whose `version` this acknowledges (None: the base weights). Its worker has read
    # that version from the adapter's store, checked every tensor, and runs it for every job it admits.
    adapter: AdapterName | None = None


class Signed(BaseModel):
    """A record's JSON with its HMAC-SHA256 (hex)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    body: StrictStr
    hmac: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class ControlMessageError(ValueError):
    """A control record that is malformed, unsigned or forged; `location` names the field."""

    def __init__(self, location: str, message: str) -> None:
        self.location = location
        self.message = message
        super().__init__(f"{location}: {message}")


def desired_state_purpose(pool: str = DEFAULT_POOL) -> str:
    """The signing purpose of a pool's desired state. The default pool keeps the single-pool one
    (its signed states stay valid); another pool's names it, so no signed state of one pool is
    obeyed in another."""
    return DESIRED_STATE_PURPOSE if pool == DEFAULT_POOL else f"{DESIRED_STATE_PURPOSE}:{pool}"


def ack_purpose(version: int, worker: str, pool: str = DEFAULT_POOL, adapter: str | None = None) -> str:
    purpose = f"ack:{version}:{worker}" if adapter is None else f"adapter-ack:{adapter}:{version}:{worker}"
    return purpose if pool == DEFAULT_POOL else f"pool:{pool}:{purpose}"


def signature(secret: bytes, purpose: str, body: str) -> str:
    return hmac.new(secret, purpose.encode() + b"\n" + body.encode(), hashlib.sha256).hexdigest()


def encode(record: BaseModel, *, secret: bytes | None, purpose: str) -> str:
    """The stored form of `record`: its JSON, inside a `Signed` envelope when there is a secret."""
    body = record.model_dump_json()
    if secret is None:
        return body
    return Signed(body=body, hmac=signature(secret, purpose, body)).model_dump_json()


Record = TypeVar("Record", bound=BaseModel)


def _location(error: Any, prefix: str = "") -> str:
    parts = [str(p) for p in error["loc"]]
    return ".".join([prefix, *parts] if prefix else parts) or "<record>"


def _validate(model: type[Record], raw: str, prefix: str) -> Record:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ControlMessageError(_location(first, prefix), first["msg"]) from exc


def decode(raw: str | bytes, model: type[Record], *, secret: bytes | None, purpose: str) -> Record:
    """Validate a stored record; with a secret, only a correctly signed one.

    Without a secret a signed envelope is accepted unverified (this reader cannot check it).
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise ControlMessageError("<record>", f"{len(raw)} bytes, over the limit of {MAX_RECORD_BYTES}")
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ControlMessageError("<record>", f"not valid JSON ({exc})") from exc
    is_envelope = isinstance(parsed, dict) and set(parsed) == {"body", "hmac"}
    if not is_envelope:
        if secret is not None:
            raise ControlMessageError("hmac", "unsigned record refused: a control secret is configured")
        return _validate(model, text, "")
    envelope = _validate(Signed, text, "")
    if secret is not None and not hmac.compare_digest(envelope.hmac, signature(secret, purpose, envelope.body)):
        raise ControlMessageError("hmac", f"signature does not match (forged, or signed for another {purpose!r})")
    return _validate(model, envelope.body, "body")

"""Property tests over control records: valid ones round-trip (signed or not); invalid, unsigned
and tampered ones are refused with a located `ControlMessageError`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.control import (
    DESIRED_STATE_PURPOSE,
    ControlMessageError,
    DesiredState,
    WeightAck,
    ack_purpose,
    decode,
    encode,
)

SECRET = b"property-secret"
secrets_ = st.one_of(st.none(), st.binary(min_size=1, max_size=32))

states = st.builds(
    DesiredState,
    generation=st.integers(0, 2**62),
    paused=st.booleans(),
    weight_version=st.integers(0, 2**62),
    weight_path=st.one_of(st.none(), st.text(min_size=1, max_size=64)),
)
acks = st.builds(
    WeightAck,
    worker=st.text(min_size=1, max_size=32),
    version=st.integers(0, 2**62),
    ok=st.booleans(),
    seconds=st.floats(0, 1e6, allow_nan=False),
    error=st.one_of(st.none(), st.text(max_size=64)),
)

# A field and a value that field must refuse.
bad_state_fields = st.sampled_from([
    ("generation", -1), ("generation", "1"), ("generation", True), ("generation", 1.5),
    ("paused", 1), ("paused", "yes"), ("weight_version", -3), ("weight_version", None),
    ("weight_path", 7), ("weight_path", ""), ("weight_path", ["a"]), ("surprise", 1),
])
bad_ack_fields = st.sampled_from([
    ("worker", ""), ("worker", 3), ("version", -1), ("version", "2"), ("ok", "true"), ("ok", 0),
    ("seconds", -0.5), ("seconds", "1"), ("error", 5), ("extra", None),
])


@settings(max_examples=150)
@given(states, secrets_)
def test_valid_states_round_trip(state: DesiredState, secret: bytes | None) -> None:
    stored = encode(state, secret=secret, purpose=DESIRED_STATE_PURPOSE)
    assert decode(stored, DesiredState, secret=secret, purpose=DESIRED_STATE_PURPOSE) == state
    # A reader without the secret still reads it (it cannot verify, and nothing breaks).
    assert decode(stored.encode(), DesiredState, secret=None, purpose=DESIRED_STATE_PURPOSE) == state


@settings(max_examples=150)
@given(acks, secrets_)
def test_valid_acks_round_trip(ack: WeightAck, secret: bytes | None) -> None:
    purpose = ack_purpose(ack.version, ack.worker)
    assert decode(encode(ack, secret=secret, purpose=purpose), WeightAck, secret=secret, purpose=purpose) == ack


def _with(record: Any, field: str, value: Any) -> str:
    return json.dumps({**record.model_dump(mode="json"), field: value})


@settings(max_examples=150)
@given(states, bad_state_fields, st.booleans())
def test_invalid_states_are_refused_with_their_field(state: DesiredState, bad: tuple[str, Any], signed: bool) -> None:
    field, value = bad
    body = _with(state, field, value)
    secret = SECRET if signed else None
    raw = body
    if signed:
        from schemas.control import Signed, signature

        raw = Signed(body=body, hmac=signature(SECRET, DESIRED_STATE_PURPOSE, body)).model_dump_json()
    with pytest.raises(ControlMessageError) as caught:
        decode(raw, DesiredState, secret=secret, purpose=DESIRED_STATE_PURPOSE)
    assert caught.value.location == (f"body.{field}" if signed else field)


@settings(max_examples=100)
@given(acks, bad_ack_fields)
def test_invalid_acks_are_refused_with_their_field(ack: WeightAck, bad: tuple[str, Any]) -> None:
    field, value = bad
    with pytest.raises(ControlMessageError) as caught:
        decode(_with(ack, field, value), WeightAck, secret=None, purpose="x")
    assert caught.value.location == field


@settings(max_examples=150)
@given(states, st.data())
def test_unsigned_tampered_or_misdirected_records_are_refused(state: DesiredState, data: st.DataObject) -> None:
    stored = encode(state, secret=SECRET, purpose=DESIRED_STATE_PURPOSE)
    envelope = json.loads(stored)
    how = data.draw(st.sampled_from(["unsigned", "body", "hmac", "key", "purpose"]))
    if how == "unsigned":
        raw = envelope["body"]
    elif how == "body":
        changed = state.model_copy(update={"paused": not state.paused})
        raw = json.dumps({**envelope, "body": changed.model_dump_json()})
    elif how == "hmac":
        flipped = ("0" if envelope["hmac"][0] != "0" else "1") + envelope["hmac"][1:]
        raw = json.dumps({**envelope, "hmac": flipped})
    elif how == "key":
        raw = encode(state, secret=b"another key", purpose=DESIRED_STATE_PURPOSE)
    else:
        raw = encode(state, secret=SECRET, purpose=ack_purpose(1, "w"))
    with pytest.raises(ControlMessageError) as caught:
        decode(raw, DesiredState, secret=SECRET, purpose=DESIRED_STATE_PURPOSE)
    assert caught.value.location == "hmac"


@given(st.one_of(st.text(max_size=40), st.binary(max_size=40)))
def test_garbage_is_refused_never_crashes(raw: str | bytes) -> None:
    try:
        decode(raw, DesiredState, secret=None, purpose=DESIRED_STATE_PURPOSE)
    except ControlMessageError as exc:
        assert exc.location


def test_envelope_shape_errors_are_located() -> None:
    with pytest.raises(ControlMessageError) as caught:
        decode(json.dumps({"body": "{}", "hmac": "xyz"}), DesiredState, secret=SECRET, purpose="p")
    assert caught.value.location == "hmac"
    with pytest.raises(ControlMessageError, match="over the limit"):
        decode("{" + " " * 70_000 + "}", DesiredState, secret=None, purpose="p")

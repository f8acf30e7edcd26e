"""A turn id is written and parsed in one place: what a server writes, it reads back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.turn_id import TurnId


@given(session=st.text(alphabet="abcdef0123456789-_", min_size=1, max_size=40), turn=st.integers(0, 10**7))
def test_a_written_id_parses_back(session: str, turn: int) -> None:
    """Session ids may hold dashes (UUIDs do): the turn and nonce are still found from the right."""
    turn_id = TurnId.new(session, turn)
    assert TurnId.parse(str(turn_id)) == turn_id


def test_two_ids_of_one_turn_differ() -> None:
    assert str(TurnId.new("s", 3)) != str(TurnId.new("s", 3))


@pytest.mark.parametrize("text", ["s-3-abcdef", "s-00003", "-00003-abcdef", "s-00003-ABCDEF"])
def test_what_is_not_a_turn_id_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a turn id"):
        TurnId.parse(text)

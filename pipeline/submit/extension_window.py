"""How much of a session's history the chat template sees when it renders what follows an earlier reply.

A verbatim session's turn keeps its parent's ids and renders only what follows the reply
(`ChatRenderer.render_after_reply`: the conversation with a marker for the reply's content, the
text after the marker). Rendered over the whole history, that costs the server O(the session) a
turn: at 128 messages the template took two thirds of a turn's server CPU. What the template
writes after the marker depends, in the templates in use, on the messages after the reply, the
ones just before it and the conversation's first message (a system prompt, or the default one a
template adds when there is none), and on where the last user query is (Qwen3 strips reasoning
before it). So the template sees a window:

- the first message;
- the last user message before the reply (a template looking back to the query finds it), with
  the one before it when needed so that an even number of messages is left out before it
  (templates that check that roles alternate count positions);
- from the query to the reply (an agent's tool loop), whole rounds are left out: the template
  sees the latest round before the reply (an assistant message and its tool results) that
  leaves an even number out, or the latest round when none does;
- the reply and everything after it.

A window is an assumption about a template, so it is checked: each template setting's (tools, tool
choice, template kwargs) first `FIRST_AUDITS` windows are rendered whole too, and after them a
window whenever the setting's windows since its last audit have rendered `audit_every - 1` times as
many messages as the history the audit renders: every `audit_every`-th window while windows are as
long as their histories, rarer as sessions grow, so the audits cost at most 1/(`audit_every` - 1) of
what the windows cost and a turn stays O(its new messages) (an audit every 32nd window would render
a 1 000-message history every 32nd turn). A mismatch logs a warning and that setting's turns render
the whole history from then on, the audited turn included. `$PIPELINE_RENDER_AUDIT_EVERY`: 1 audits
every turn, 0 turns windows off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pipeline.core import settings
from schemas.chat import ChatMessage, ChatRequest

log = logging.getLogger(__name__)

FIRST_AUDITS = 4


def window_positions(messages: Sequence[ChatMessage], boundary: int) -> list[int] | None:
    """The indices of the messages the template sees around the reply at `boundary`; None when
    the window would leave nothing out."""
    query = next((k for k in range(boundary - 1, 0, -1) if messages[k].role == "user"), None)
    # Before the query: an even number left out, so that roles keep their positions' parity.
    kept_from = 1 if query is None else query - (query - 1) % 2
    # Between the query and the reply (an agent's tool loop): whole rounds left out, from the
    # assistant message after the query up to the latest round before the reply, an even number
    # of messages where some round allows it.
    after = 1 if query is None else query + 1
    rounds = [k for k in range(after + 1, boundary) if messages[k].role == "assistant"]
    even = [k for k in rounds if (k - after) % 2 == 0]
    resume = (even or rounds or [after])[-1]
    if kept_from <= 1 and resume <= after:
        return None
    head = [0] if query is None else [0, *range(max(kept_from, 1), query + 1)]
    return [*head, *range(resume, len(messages))]


class ExtensionWindow:
    """Windows for `render_after_reply`, and their audits, per template setting."""

    def __init__(self, audit_every: int | None = None) -> None:
        self.audit_every = settings.render_audit_every() if audit_every is None else audit_every
        self._lock = threading.Lock()
        # template setting -> windows rendered, messages they rendered since its last audit
        self._windows: dict[str, tuple[int, int]] = {}
        self._refused: dict[str, str] = {}  # template setting -> why its turns render whole

    @staticmethod
    def setting(request: ChatRequest) -> str:
        """The request's template setting (what the windows' audits are kept by): taken once a turn."""
        return request.model_dump_json(include={"tools", "tool_choice", "chat_template_kwargs",
                                                "continue_final_message"})

    def positions(self, setting: str, messages: Sequence[ChatMessage], boundary: int) -> list[int] | None:
        """The window for this turn of template setting `setting`, or None: render the whole history."""
        if self.audit_every <= 0 or setting in self._refused:
            return None
        return window_positions(messages, boundary)

    def audit_due(self, setting: str, window: int, history: int) -> bool:
        """Count a window of `window` messages of `setting` over a history of `history`; True when it
        is to be checked against the whole history (the module's docstring says when)."""
        with self._lock:
            count, since = self._windows.get(setting, (0, 0))
            due = count < FIRST_AUDITS or since >= (self.audit_every - 1) * history
            self._windows[setting] = (count + 1, 0 if due else since + window)
        return due

    def refuse(self, setting: str, windowed: str, whole: str) -> None:
        """The template rendered `windowed` over the window and `whole` over the whole history: this
        setting's turns render whole from now on."""
        at = next((i for i, (a, b) in enumerate(zip(windowed, whole, strict=False)) if a != b),
                  min(len(windowed), len(whole)))
        why = (f"at character {at} of what follows the reply, the window gives {windowed[at:at + 40]!r} and "
               f"the whole history {whole[at:at + 40]!r}")
        with self._lock:
            self._refused[setting] = why
        log.warning("the chat template renders what follows a reply differently when it sees only a window of "
                    "the history (%s); turns with these tools and template settings render the whole history "
                    "from now on (O(the session) a turn)", why)

    def refused(self, request: ChatRequest) -> str | None:
        """Why this setting's turns render the whole history, or None."""
        return self._refused.get(self.setting(request))

"""`pipeline worker` on an hf engine the test can hold (with or without LoRA adapters): each decode group stops after
`HELD_AFTER_TOKENS` tokens of every sample and waits there until the group is stopped (a partial
swap interrupts it; it then ends with exactly those tokens) or the process is killed.

A kill test then finds every sample mid-way whatever the machine's speed: the tiny model would
otherwise finish a sample before the test sees its checkpoint, and the job's commit deletes it.
Everything else is the real worker: `python -m tests.workers.jobs.held_hf_worker worker ...`
takes `pipeline`'s own arguments (`workers.engines.factory` builds this engine for `--engine hf`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pipeline.cli.main import main
from workers.engines.hf import engine as hf

HOLD_VARIABLE = "HELD_AFTER_TOKENS"


class _HoldingModel:
    """The model, called once for the prompt and then once per token: the call after the
    `hold_after`-th token waits for `stop` (forever when the group has none)."""

    def __init__(self, model: Any, stop: threading.Event | None, hold_after: int) -> None:
        self.model = model
        self.stop = stop or threading.Event()
        self.hold_after = hold_after
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.hold_after:  # every sample has `hold_after` tokens (the first call is the prompt)
            self.stop.wait()
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class HeldHFEngine(hf.HFEngine):
    def _decode_group(self, requests: Sequence[Any], routing: Any, stop: threading.Event | None) -> Any:
        where = "model" if self._peft is None else "_peft"  # with adapters loaded, peft's wrapper decodes
        real = getattr(self, where)
        held = _HoldingModel(real, stop, int(os.environ[HOLD_VARIABLE]))
        setattr(self, where, held)
        try:
            return super()._decode_group(requests, routing, stop)
        finally:
            if getattr(self, where) is held:  # a swap may have put the new weights' model there meanwhile
                setattr(self, where, real)


if __name__ == "__main__":
    hf.HFEngine = HeldHFEngine  # type: ignore[misc]  # what the factory builds for --engine hf
    sys.exit(main())

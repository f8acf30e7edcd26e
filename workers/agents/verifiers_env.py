"""A verifiers environment as an agent, with no glue: `--agent workers.agents.verifiers_env:ENV_ID`.

The attribute names the environment (verifiers 0.4's v1 API, loaded by id as
`load_environment(resolve_env_config({"taskset": {"id": ENV_ID}, ...}))`: an id that is a Python
name). Each episode runs one rollout of one of the environment's tasks
against the episode's session: verifiers' own harness makes the calls (its chat program, its
tools, its sandbox or runtime), its rubric gives the reward. A task line picks the environment's
task by `index` (default 0) and may set `sampling` (verifiers' `SamplingConfig` fields) and
`runtime` (default `{"type": "subprocess"}`: verifiers' own default is a remote sandbox).

The harness makes its own model calls, so the worker counts the episode's turns from its session
and `--max-turns` cannot stop it mid-rollout; the rollout's own limits apply.
"""

from __future__ import annotations

from typing import Any

from pipeline.core import settings

# verifiers reads the server's API key from a variable it is given the name of: the agent worker's own
# (`settings.SERVE_API_KEY`; unset, verifiers sends "EMPTY"). A key given as `--api-key` does not reach it.
API_KEY_VAR = settings.SERVE_API_KEY.name


class VerifiersAgent:
    """Runs a rollout of environment `env_id` per episode; its rubric's reward is the episode's."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def _environment(self, task: dict[str, Any]) -> Any:
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        runtime = task.get("runtime") or {"type": "subprocess"}
        return load_environment(resolve_env_config({"taskset": {"id": self.env_id}, "agent": {"runtime": runtime}}))

    async def __call__(self, task: dict[str, Any], client: Any, episode: Any) -> dict[str, Any]:
        import verifiers.v1 as vf

        env = self._environment(task)
        tasks = list(env.taskset)
        index = int(task.get("index", 0))
        if not 0 <= index < len(tasks):
            raise ValueError(f"verifiers environment {self.env_id!r} has {len(tasks)} tasks; index {index} is not one")
        ctx = vf.ModelContext(model=str(task.get("model", "policy")),
                              client=vf.EvalClientConfig(base_url=episode.base_url, api_key_var=API_KEY_VAR),
                              sampling=vf.SamplingConfig(**(task.get("sampling") or {})))
        async with env.serving():
            (slot,) = env.slots(tasks[index], 1)
            result = await env.run_slot(slot, ctx)
        if not result.ok:
            raise RuntimeError(f"the verifiers rollout failed: {result.errors}")
        (trace,) = result.traces
        rewards = {name: value for name, value in (trace.rewards or {}).items() if isinstance(value, int | float)}
        return {"reward": float(trace.reward), "rewards": rewards, "verifiers_trace": trace.id}


def __getattr__(env_id: str) -> VerifiersAgent:
    if env_id.startswith("__"):
        raise AttributeError(env_id)
    return VerifiersAgent(env_id)

"""A verifiers 0.4.0 (v1 API) environment for `test_verifiers.py`: one task (2 + 3), one MCP tool
advertised as `calc_add`, a reward for the right answer, and a harness running verifiers' own
bundled chat program with this interpreter.

Loaded by id (`vf_calc_env`), and served to each rollout as `python -m vf_calc_env` (verifiers'
subprocess runtime), so this folder goes on PYTHONPATH. The stock `null` and `bash` harnesses
bootstrap `uv` and sync the chat program's dependencies from the network; `LocalChatHarness` runs
the same program with the same arguments, offline.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

QUESTION = "What is 2 + 3? Use the calc_add tool."


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"  # advertised to the model as `calc_add`

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AddData(vf.TaskData):
    answer: str


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config: AddTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.answer in (trace.last_reply or "") else 0.0


class CalcConfig(vf.TasksetConfig):
    task: AddTaskConfig = AddTaskConfig()


class CalcTaskset(vf.Taskset[AddTask, CalcConfig]):
    def load(self) -> Any:
        yield AddTask(AddData(prompt=QUESTION, answer="5"), self.config.task)


class LocalChatHarness(NullHarness):
    """verifiers' chat program (`launch_chat_program`'s argv), run by `sys.executable`, not `uv run`."""

    async def setup(self, runtime: vf.Runtime) -> None:  # NullHarness would `uv sync` here
        pass

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> Any:
        system_prompt, prompt = self.resolve_prompt(data)
        args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
        if tool_interception_url:
            args.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            args.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
            args.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f".vf-initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.append(f"--initial-messages-file={path}")
        await runtime.write("vf_chat_program.py", CHAT_PROGRAM_SOURCE.encode())
        return await runtime.run_program([sys.executable, "vf_chat_program.py", *args],
                                         {**self.config.resolved_env})


__all__ = ["CalcTaskset", "LocalChatHarness"]

if __name__ == "__main__":  # how verifiers serves the toolset to a rollout
    CalcToolset.run()

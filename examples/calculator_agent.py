"""An agent that must use a tool: two-digit multiplication with a calculator (`examples/learn_episodes.py`).

    pipeline submit tasks.jsonl --agent examples.calculator_agent:solve --n 4 --run calc
    pipeline agent-worker --agent examples.calculator_agent:solve --serve http://127.0.0.1:8000

A task is `{"id": ..., "a": 47, "b": 38}`. The model is told it has a calculator: a reply
`CALC: <expression>` is evaluated (digits and + - * / ( ) only) and the result sent back as the
next user message `RESULT: <value>`; the reply after that is its answer. The reward is 1.0 when
the answer's last number is a × b, else 0.0. SmolLM2-135M-Instruct cannot multiply two-digit
numbers, so it scores only by calling the tool with the right operands and reading the result
back; one worked example in the prompt gets it to try about half the time, and GRPO on the
episodes teaches it the rest.

The tool protocol is plain text, not OpenAI `tools`: the demo model's chat template ignores tool
definitions, so a harness that parses the model's own words is what works on it (any model whose
template renders tools can use `tools=` and a `--tool-call-parser` instead; the episode is
exact either way). The info the episode records: `called_tool`, `well_formed` (the expression
evaluated) and `turns`.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

SYSTEM = ("You can use a calculator. To use it, reply with CALC: followed by the expression, like CALC: 12*34. "
          "You will get the result back. Then reply with the final answer only.")
EXAMPLE = [{"role": "user", "content": "What is 17 * 23?"}, {"role": "assistant", "content": "CALC: 17*23"},
           {"role": "user", "content": "RESULT: 391"}, {"role": "assistant", "content": "391"}]
CALL = re.compile(r"CALC:\s*([0-9+\-*/ ().]+)")
MAX_TOKENS = 24
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def question(task: dict[str, Any]) -> list[dict[str, str]]:
    """The episode's first prompt: the system prompt, the worked example, the question."""
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE,
            {"role": "user", "content": f"What is {int(task['a'])} * {int(task['b'])}?"}]


def calculate(expression: str) -> int | float | None:
    """The value of an arithmetic expression (numbers, + - * /, parentheses), or None if it is not one."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    return int(result) if float(result).is_integer() else round(result, 6)


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


async def solve(task: dict[str, Any], client: Any, episode: Any) -> dict[str, Any]:
    """One episode: ask, run the calculator if the model calls it, read the answer; the reward."""
    messages = question(task)

    async def reply() -> str:
        answer = await client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=float(task.get("temperature", 1.0)))
        text = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        return text

    text = await reply()
    call = CALL.search(text)
    info: dict[str, Any] = {"called_tool": call is not None, "well_formed": False, "turns": 1}
    if call is not None:
        result = calculate(call.group(1))
        info["well_formed"] = result is not None
        messages.append({"role": "user", "content": f"RESULT: {'error' if result is None else result}"})
        text = await reply()
        info["turns"] = 2
    correct = last_number(text) == int(task["a"]) * int(task["b"])
    return {"reward": 1.0 if correct else 0.0, **info}

"""An example plugin for the long-task runtime: the `hello` agent greets each name in its
input, one step per name, through the `hello.shout` tool (which goes through the ledger
like any tool: exactly once, approvals, budgets).

    pip install examples/runtime-hello        # into the runtime's environment
    rt submit --agent hello --input '{"names": ["Ada", "Linus"]}' --watch
"""

from __future__ import annotations

from typing import Any

from tasks_app.agents.base import Agent, StepContext
from tasks_app.agents.tools import Tool

__version__ = "0.1.0"


def _shout(args: dict[str, Any], key: str, timeout: float) -> Any:
    return {"greeting": f"HELLO, {args['name'].upper()}!"}


SHOUT = Tool(
    name="hello.shout",
    side_effect=False,
    call=_shout,
    input_schema={
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1}},
        "required": ["name"],
        "additionalProperties": False,
    },
)


class HelloAgent(Agent):
    name = "hello"
    description = "Greets each name, one step per name, through the hello.shout tool."
    input_schema = {
        "type": "object",
        "properties": {"names": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 100}},
        "required": ["names"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {"greetings": {"type": "array", "items": {"type": "string"}}},
        "required": ["greetings"],
    }

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"names": input["names"], "greetings": []}

    def next_step(self, state: dict[str, Any]) -> str | None:
        done = len(state["greetings"])
        return f"greet-{done + 1}" if done < len(state["names"]) else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        name = state["names"][len(state["greetings"])]
        greeting = ctx.tool("hello.shout", {"name": name})["greeting"]
        ctx.progress((len(state["greetings"]) + 1) / len(state["names"]), phase="greeting", message=greeting)
        return {**state, "greetings": [*state["greetings"], greeting]}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"greetings": state["greetings"]}

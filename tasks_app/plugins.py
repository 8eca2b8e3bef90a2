"""Agents and tools from other installed packages, through entry points (DESIGN §12):

    [project.entry-points."long_task_runtime.agents"]
    hello = "runtime_hello:HelloAgent"          # an Agent subclass
    [project.entry-points."long_task_runtime.tools"]
    "hello.shout" = "runtime_hello:SHOUT"       # a ledger_app.tools.Tool

A plugin adds; it never replaces: a name the runtime (or another plugin) has already
registered is refused, so no package can swap email.send or an agent for its own. A
plugin that fails to load is logged and skipped; it cannot keep workers from starting.
examples/runtime-hello is one to copy.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)

AGENTS_GROUP = "long_task_runtime.agents"
TOOLS_GROUP = "long_task_runtime.tools"


def load() -> list[str]:
    """Register what installed packages offer; the names registered."""
    from ledger_app import tools
    from tasks_app.agents import base
    from tasks_app.agents import tools as registry

    loaded = []
    for ep in entry_points(group=TOOLS_GROUP):
        try:
            tool = ep.load()
            if not isinstance(tool, registry.Tool):
                raise TypeError(f"{ep.value} is not a tasks_app.agents.tools.Tool")
            if tool.name in registry.tool_names():
                raise ValueError(f"a tool named {tool.name!r} is registered already")
            tools.register(tool)
            loaded.append(tool.name)
        except Exception:
            logger.exception("tool plugin %s (%s) not loaded", ep.name, ep.value)
    for ep in entry_points(group=AGENTS_GROUP):
        try:
            agent = ep.load()
            if not (isinstance(agent, type) and issubclass(agent, base.Agent)):
                raise TypeError(f"{ep.value} is not an Agent subclass")
            if agent.name in base.agent_names():
                if base._REGISTRY[agent.name] is agent:
                    continue  # loaded before (the same class)
                raise ValueError(f"an agent named {agent.name!r} is registered already")
            base.register(agent)
            loaded.append(agent.name)
        except Exception:
            logger.exception("agent plugin %s (%s) not loaded", ep.name, ep.value)
    if loaded:
        logger.info("plugins loaded: %s", ", ".join(loaded))
    return loaded

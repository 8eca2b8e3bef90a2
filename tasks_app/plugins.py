"""Agents and tools from other installed packages, through entry points (DESIGN §12):

    [project.entry-points."long_task_runtime.agents"]
    hello = "runtime_hello:HelloAgent"          # an Agent subclass
    [project.entry-points."long_task_runtime.tools"]
    "hello.shout" = "runtime_hello:SHOUT"       # a ledger_app.tools.Tool

A plugin adds; it never replaces: a name the runtime (or another plugin) has already
registered is refused, so no package can swap email.send or an agent for its own. A
plugin that fails to load is logged and skipped; it cannot keep workers from starting.
examples/runtime-hello is one to copy; its README says what a tool that sends must do
(tasks_app.agents.tools.before_send).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

AGENTS_GROUP = "long_task_runtime.agents"
TOOLS_GROUP = "long_task_runtime.tools"


@contextlib.contextmanager
def _refused_whole() -> Iterator[None]:
    """Importing a plugin runs its code. Whatever that registered on the way stays only if
    the plugin loads: a plugin that raises, or calls sys.exit (which would otherwise stop
    the worker or web process loading it), or whose import replaced a name already taken (a
    module-level tools.register of "email.send") is refused whole, the registries as before."""
    from tasks_app.agents import base
    from tasks_app.agents import tools as registry

    registries: tuple[dict[str, Any], ...] = (registry._TOOLS, base._REGISTRY)
    before = [dict(r) for r in registries]
    try:
        yield
        replaced = sorted(n for r, was in zip(registries, before, strict=True) for n in was if r.get(n) is not was[n])
        if replaced:
            raise ValueError(f"importing it replaced {', '.join(replaced)}, registered already")
    except BaseException:
        for r, was in zip(registries, before, strict=True):
            r.clear()
            r.update(was)
        raise


def load() -> list[str]:
    """Register what installed packages offer; the names registered."""
    from ledger_app import tools
    from tasks_app.agents import base
    from tasks_app.agents import tools as registry

    loaded = []
    for ep in entry_points(group=TOOLS_GROUP):
        try:
            with _refused_whole():
                tool = ep.load()
                if not isinstance(tool, registry.Tool):
                    raise TypeError(f"{ep.value} is not a tasks_app.agents.tools.Tool")
                if tool.name in registry.tool_names():
                    raise ValueError(f"a tool named {tool.name!r} is registered already")
                tools.register(tool)
            loaded.append(tool.name)
        except (Exception, SystemExit):
            logger.exception("tool plugin %s (%s) not loaded", ep.name, ep.value)
    for ep in entry_points(group=AGENTS_GROUP):
        try:
            with _refused_whole():
                agent = ep.load()
                if not (isinstance(agent, type) and issubclass(agent, base.Agent)):
                    raise TypeError(f"{ep.value} is not an Agent subclass")
                if agent.name in base.agent_names():
                    if base._REGISTRY[agent.name] is agent:
                        continue  # loaded before (the same class)
                    raise ValueError(f"an agent named {agent.name!r} is registered already")
                base.register(agent)
            loaded.append(agent.name)
        except (Exception, SystemExit):
            logger.exception("agent plugin %s (%s) not loaded", ep.name, ep.value)
    if loaded:
        logger.info("plugins loaded: %s", ", ".join(loaded))
    return loaded

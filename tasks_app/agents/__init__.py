"""Agent registry; importing this package registers the built-in agents."""

from tasks_app.agents import document_review, noop, planner, tool_calls, webhook  # noqa: F401
from tasks_app.agents.base import Agent, StepContext, UnknownAgent, agent_names, get_agent, register

from django.conf import settings  # isort: skip

if getattr(settings, "RUNTIME_MCP_FIXTURES", False):  # the conformance suite's fixture tools
    from tasks_app.agents import conformance  # noqa: F401

from tasks_app import plugins  # noqa: E402  (after the built-ins: a plugin may not take their names)

plugins.load()

__all__ = ["Agent", "StepContext", "UnknownAgent", "agent_names", "get_agent", "register"]

"""Agent registry; importing this package registers the built-in agents."""

from tasks_app.agents import document_review, noop, tool_calls, webhook  # noqa: F401
from tasks_app.agents.base import Agent, StepContext, UnknownAgent, agent_names, get_agent, register

__all__ = ["Agent", "StepContext", "UnknownAgent", "agent_names", "get_agent", "register"]

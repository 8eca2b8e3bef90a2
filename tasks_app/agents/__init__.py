"""Agent registry; importing this package registers the built-in agents."""

import tasks_app.agents.document_review.agent  # noqa: F401
from tasks_app.agents import noop, tool_calls, webhook  # noqa: F401
from tasks_app.agents.base import Agent, StepContext, UnknownAgent, agent_names, get_agent, register

__all__ = ["Agent", "StepContext", "UnknownAgent", "agent_names", "get_agent", "register"]

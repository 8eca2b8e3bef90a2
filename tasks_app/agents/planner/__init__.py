"""The planner (DESIGN §12): an agent driven by a language model. The model proposes; the
runtime disposes: every tool call it asks for goes through ctx.tool, the policy guard and
the ledger."""

from tasks_app.agents.planner.agent import PlannerAgent

__all__ = ["PlannerAgent"]

"""The engine's observation points, in one place: a slice, a step, a tool call.

Each is a context manager or a wrapper the engine, the Celery task and the tool registry
put around what they already do, so that what is measured (runtime_site/metrics.py) stays
out of the code that does the work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from runtime_site import metrics
from tasks_app.agents import base as agents


@contextmanager
def step(task: Any, name: str, sequence: int) -> Iterator[None]:
    """Around one agent step: its duration by agent and outcome."""
    t0, outcome = time.perf_counter(), "ok"
    try:
        yield
    except (agents.InputNeeded, agents.RemoteWait):
        outcome = "waiting"  # asked a person, or a remote task runs: not a failure
        raise
    except BaseException:
        outcome = "error"
        raise
    finally:
        metrics.STEP_SECONDS.labels(task.agent, outcome).observe(time.perf_counter() - t0)


def tool(name: str, call: Callable[[dict[str, Any], str, float], Any]) -> Callable[[dict[str, Any], str, float], Any]:
    """Wraps a tool's call (or poll) hook: every attempt counted by outcome."""

    def observed(args: dict[str, Any], key: str, timeout: float) -> Any:
        try:
            result = call(args, key, timeout)
        except BaseException:
            metrics.TOOL_CALLS.labels(name, "error").inc()
            raise
        metrics.TOOL_CALLS.labels(name, "ok").inc()
        return result

    return observed

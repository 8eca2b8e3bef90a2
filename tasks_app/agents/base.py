"""The agent interface. Agents see their goal, input and structured state, and a step
context; they never see Celery, leases or SQL (DESIGN §4)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jsonschema

from runtime_site.blobstore import BlobStore
from tasks_app.agents.questions import check_agent_key


class InputNeeded(Exception):  # a signal to the engine, not an error
    """Raised by ctx.ask() (or a guarded tool call): the step cannot go on until a person
    answers. kind (tasks_app.agents.questions.QuestionKind) "approval" answers need the approver role."""

    def __init__(
        self, key: str, prompt: str, schema: dict[str, Any], kind: str = "question", also: tuple[InputNeeded, ...] = ()
    ) -> None:
        super().__init__(f"input needed: {key}")
        self.key, self.prompt, self.schema, self.kind = key, prompt, schema, kind
        self.also = also  # further questions the step asks at the same time (ctx.ask_all)


class RemoteWait(Exception):  # a signal to the engine, not an error
    """Raised by a tool call whose remote task is still running: the step ends without
    committing, the slice yields, and a later slice runs the step again, which polls the
    same remote task (the ledger holds its id) instead of calling again."""

    def __init__(self, message: str, *, poll_after: float = 1.0) -> None:
        super().__init__(message)
        self.message, self.poll_after = message, poll_after


class ToolFailure(Exception):
    """A tool call failed for good (a permanent error, or its retries used up): raised by
    ctx.tool. Uncaught, it fails the step with its reason; an agent may catch it."""


class ToolRejected(Exception):
    """An approver said no to a guarded call; the agent may catch it and take its rejection path."""


@dataclass
class StepContext:
    """What one step may touch. The engine commits what it collects with the step."""

    task_id: str
    goal: str
    input: dict[str, Any]
    step_name: str
    sequence: int
    blobs: BlobStore
    progress_value: float | None = None
    phase: str | None = None
    message: str | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    artifacts: list[dict[str, str]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    answers: dict[str, Any] = field(default_factory=dict)  # answered input requests, by key
    # Set by the engine: runs a tool exactly once through the ledger (name, args, call index).
    tool_runner: Callable[[str, dict[str, Any], int], Any] | None = None
    calls: int = 0
    cost: float = 0.0  # reported by the step (model tokens, paid APIs); counts against maxCost
    audits: list[dict[str, Any]] = field(default_factory=list)  # records for the task's audit chain

    def progress(self, fraction: float, *, phase: str | None = None, message: str | None = None) -> None:
        self.progress_value = min(max(float(fraction), 0.0), 1.0)
        if phase is not None:
            self.phase = phase
        if message is not None:
            self.message = message

    def report_cost(self, amount: float) -> None:
        """Add to the task's cost (in whatever unit its budget's maxCost uses). A finite
        number, at least 0: NaN is under every cap and infinity over it, so either would
        switch maxCost and the tenant's daily quota off or on (limits.cost_per_tenant_day)."""
        amount = float(amount)
        if not math.isfinite(amount) or amount < 0:
            raise ValueError(f"a cost must be a finite number, at least 0 (not {amount})")
        self.cost += amount

    def log(self, message: str, **fields: Any) -> None:
        self.logs.append({"message": message, **fields})

    def audit(self, action: str, *, reason: str = "", **data: Any) -> None:
        """A record for the task's audit chain, written with the step's commit (none if the
        step fails). For decisions an operator must be able to trace, e.g. a model switch."""
        self.audits.append({"action": action, "reason": reason[:500], "data": data})

    def artifact(self, name: str, content: bytes | str, content_type: str) -> str:
        """Write an artifact to the blob store (same key on a re-run) and return its reference."""
        data = content.encode() if isinstance(content, str) else content
        ref = self.blobs.put(f"tasks/{self.task_id}/artifacts/{name}", data, content_type)
        self.artifacts.append({"name": name, "ref": ref, "contentType": content_type})
        return ref

    def tool(self, name: str, args: dict[str, Any]) -> Any:
        """Call a registered tool. Its effect happens once even if this step runs again:
        the n-th call of a step is the same ledger entry on every run."""
        if self.tool_runner is None:
            raise RuntimeError("tools are only available to steps run by the engine")
        self.calls += 1
        return self.tool_runner(name, args, self.calls)

    def ask(self, key: str, prompt: str, schema: dict[str, Any]) -> Any:
        """The answer to a question for a person. Unanswered, the task waits in input_required
        (after checkpointing) and this step runs again once the answer is in."""
        check_agent_key(key)
        if key in self.answers:
            return self.answers[key]
        raise InputNeeded(key, prompt, schema)

    def ask_all(self, questions: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """Several questions at once ({key: (prompt, schema)}): all are open together and
        may be answered in any order; the step runs again once every one is answered."""
        for key in questions:
            check_agent_key(key)
        missing = [
            InputNeeded(key, prompt, schema) for key, (prompt, schema) in questions.items() if key not in self.answers
        ]
        if missing:
            first, *rest = missing
            raise InputNeeded(first.key, first.prompt, first.schema, also=tuple(rest))
        return {key: self.answers[key] for key in questions}

    def read_blob(self, key: str) -> bytes:
        return self.blobs.get(key)

    def list_blobs(self, prefix: str) -> list[str]:
        return self.blobs.list(prefix)


@dataclass(frozen=True)
class McpOptions:
    """How an agent shows as a tool on /mcp (mcp_server/, docs/mcp.md)."""

    # "forbidden" (answered synchronously, never a task), "optional", "required".
    task_support: str = "required"
    # What the calling client must have declared (else the call is refused with -32021).
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    # Questions asked by MRTR before the task exists, and the argument each answer fills in:
    # {key: {"message", "requestedSchema", "argument", "field"}}.
    preflight: dict[str, Any] = field(default_factory=dict)


class Agent:
    """Subclass, set the class attributes, implement the four methods, decorate with @register."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    output_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    # JSON schema of the constraints adjust_goal may set; None: the agent cannot be re-aimed.
    constraints_schema: ClassVar[dict[str, Any] | None] = None
    # How long one step may run, in seconds, before it is abandoned and the task recovered as
    # after a crash (None: runtime.step_seconds; 0: no limit). Override step_deadline() to vary it by step.
    step_seconds: ClassVar[float | None] = None
    mcp: ClassVar[McpOptions] = McpOptions()

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        """The initial structured state (JSON-serialisable)."""
        raise NotImplementedError

    def next_step(self, state: dict[str, Any]) -> str | None:
        """The name of the next step, or None when the work is done."""
        raise NotImplementedError

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        """Run the step named by next_step(state) and return the new state."""
        raise NotImplementedError

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        """The final output; must validate against output_schema."""
        raise NotImplementedError

    def step_deadline(self, step_name: str) -> float | None:
        """Seconds the named step may run (None: runtime.step_seconds)."""
        return self.step_seconds

    def mcp_tool_result(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """The CallToolResult fields (content, isError) a completed run shows on /mcp; None:
        the result as JSON text."""
        return None

    def replan(self, state: dict[str, Any], goal: str, constraints: dict[str, Any]) -> dict[str, Any]:
        """The state re-aimed at a new goal and constraints. An agent whose plan does not
        depend on them keeps its state."""
        return state


_REGISTRY: dict[str, type[Agent]] = {}


class UnknownAgent(LookupError):
    pass


def register(cls: type[Agent]) -> type[Agent]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"agent {cls.name!r} registered twice")
    jsonschema.Draft202012Validator.check_schema(cls.input_schema)
    jsonschema.Draft202012Validator.check_schema(cls.output_schema)
    _REGISTRY[cls.name] = cls
    return cls


def get_agent(name: str) -> Agent:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise UnknownAgent(name) from None


def agent_names() -> list[str]:
    return sorted(_REGISTRY)

"""The planner agent: think, act, think, act ... until the model calls finish.

    think-N  one model call (`llm.chat` through the ledger). Its answer's tool calls are
             checked and kept in the state as `pending`; a malformed one is sent back to the
             model once (the next prompt says what was wrong), a second fails the step.
    act-N    carries out the pending calls in order: tools through ctx.tool (guard, ledger,
             approvals, budgets), questions through ctx.ask, the plan and the final answer
             in the state.

Splitting the two makes every step deterministic on a re-run: a think that runs again
(after a crash) gets its stored answer from the ledger, and an act that runs again (after
a crash, an approval or an answer) makes the same calls under the same keys, which the
ledger replays. A model call's key also carries the plan version, so a think re-run after
the goal was adjusted asks afresh instead of clashing with the old question.

What the state keeps (seed §8): the plan with each step's status, plan_version, facts
(summaries of tool results, with artifact refs for large outputs), usage. Never the
conversation: each prompt is rebuilt from the state (prompt.py) and bounded in size.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from django.conf import settings

from common.schema import SchemaError, validate
from tasks_app.agents.base import Agent, InputNeeded, StepContext, ToolRejected, register
from tasks_app.agents.planner import catalog, prompt, screening

MAX_FACTS = 200  # kept in the state; the prompt shows as many of the newest as fit
BIG_RESULT = 2000  # characters: a larger tool result goes to an artifact, its summary to the facts
SUMMARY = 600


class PlannerError(Exception):
    """The model cannot be worked with (a second malformed answer, no finish in time)."""


def _models() -> list[str]:
    from ledger_app import llm

    return llm.model_names()


@register
class PlannerAgent(Agent):
    name = "planner"
    description = (
        "A language model plans toward the goal and calls tools through the ledger "
        "(exactly once, approvals, budgets), asks people, and re-plans when steered."
    )
    input_schema = {
        "type": "object",
        "properties": {
            "goal": {"type": "string", "minLength": 1, "maxLength": 10_000},
            "constraints": {"type": "array", "items": {"type": "string", "maxLength": 2000}, "maxItems": 50},
            # tool names (glob patterns) the model may use: "http.request", "crm.*"; all allowed ones if left out
            "tools": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 100},
            "model": {"type": "string", "minLength": 1},  # a model named in config (llm.models), else the default
            "maxRounds": {"type": "integer", "minimum": 1, "maximum": 500},
        },
        "required": ["goal"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "plan": {"type": "array"},
            "planVersion": {"type": "integer"},
            "model": {"type": "string"},
            "usage": {"type": "object"},
            "facts": {"type": "integer"},
        },
        "required": ["answer", "plan", "planVersion", "usage"],
    }
    # A step is one model call (with the ledger's retries) or a few tool calls.
    step_seconds = 3 * 600 + 60

    @property
    def constraints_schema(self) -> dict[str, Any]:  # type: ignore[override]
        """adjust_goal may add rules and move the task to another configured model."""
        return {
            "type": "object",
            "properties": {
                "rules": {"type": "array", "items": {"type": "string", "maxLength": 2000}, "maxItems": 50},
                "model": {"enum": _models()},
            },
            "additionalProperties": False,
        }

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {
            "goal": input["goal"],
            "constraints": list(input.get("constraints", [])),
            "tools": input.get("tools"),
            "model": input.get("model") or "default",
            "maxRounds": input.get("maxRounds", 50),
            "catalog": None,
            "plan": [],
            "planVersion": 1,
            "facts": [],
            "factsDropped": 0,
            "pending": [],
            "notes": [],
            "repairs": 0,
            "rounds": 0,
            "answer": None,
            "done": False,
            "models": [],
            "usage": {"modelCalls": 0, "inputTokens": 0, "outputTokens": 0, "cost": 0.0, "perStep": []},
        }

    def next_step(self, state: dict[str, Any]) -> str | None:
        if state["pending"]:
            return f"act-{state['rounds']}"
        return None if state["done"] else f"think-{state['rounds'] + 1}"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        state = copy.deepcopy(state)
        return self._act(ctx, state) if state["pending"] else self._think(ctx, state)

    def replan(self, state: dict[str, Any], goal: str, constraints: dict[str, Any]) -> dict[str, Any]:
        """Re-aimed: plan_version + 1; the next prompt asks for a new plan that keeps the done
        steps (update_plan cannot undo them anyway). A new model is recorded and told to
        re-validate the plan against the facts before going on."""
        state = copy.deepcopy(state)
        state["planVersion"] += 1
        if goal:
            state["goal"] = goal
        state["constraints"] = [
            *state["constraints"],
            *[r for r in constraints.get("rules", []) if r not in state["constraints"]],
        ]
        state["notes"].append(
            f"The goal or constraints were adjusted (plan version {state['planVersion']}). "
            "Re-plan with update_plan: keep the steps that are done, revise the rest."
        )
        model = constraints.get("model")
        if model and model != state["model"]:
            state["models"].append({"from": state["model"], "to": model, "planVersion": state["planVersion"]})
            state["model"] = model
            state["notes"].append(
                "You take this task over from another model. First re-validate the plan "
                "against the facts (update_plan), then go on."
            )
        return state

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        usage = {k: v for k, v in state["usage"].items() if k != "perStep"}
        return {
            "answer": state["answer"] or "",
            "plan": state["plan"],
            "planVersion": state["planVersion"],
            "model": state["model"],
            "usage": {**usage, "perStep": state["usage"]["perStep"][-100:]},
            "facts": len(state["facts"]) + state["factsDropped"],
        }

    # --- think: one model call ---------------------------------------------------------------

    def _think(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if state["rounds"] >= state["maxRounds"]:
            raise PlannerError(f"the model did not finish within {state['maxRounds']} rounds (maxRounds)")
        if state["catalog"] is None:
            state["catalog"], notes = catalog.build(state["tools"])
            state["notes"] += notes
        args = {
            "model": state["model"],
            "system": prompt.SYSTEM,
            "prompt": prompt.render(state, limit=int(settings.RUNTIME["llm"]["max_context_chars"])),
            "tools": catalog.functions(state["catalog"]),
        }
        ctx.calls = state["planVersion"] * 1000  # this step's model call has a key per plan version
        answer = ctx.tool("llm.chat", args)
        state["rounds"] += 1
        self._count(ctx, state, answer)
        calls, problems = self._check(state["catalog"], answer.get("toolCalls", []))
        if not calls and not problems:
            if answer.get("text", "").strip():  # a plain answer is the final one
                state["answer"], state["done"] = answer["text"].strip(), True
                state["notes"] = []
                return state
            problems = ["the answer had neither tool calls nor text"]
        if problems:
            if state["repairs"] >= 1:
                raise PlannerError(f"the model's answer was unusable twice; the second time: {'; '.join(problems)}")
            state["repairs"] += 1
            state["notes"] = [
                f"Your last answer could not be carried out: {'; '.join(problems)}. "
                "Nothing of it was done. Answer again with valid tool calls."
            ]
            ctx.log("malformed tool call sent back to the model", problems=problems)
            return state
        state["repairs"], state["notes"], state["pending"] = 0, [], calls
        ctx.progress(
            self._progress(state),
            phase="planning",
            message=f"round {state['rounds']}: {', '.join(c['name'] for c in calls)}",
        )
        return state

    def _count(self, ctx: StepContext, state: dict[str, Any], answer: dict[str, Any]) -> None:
        usage = answer.get("usage") or {}
        total = state["usage"]
        total["modelCalls"] += 1
        total["inputTokens"] += int(usage.get("inputTokens", 0))
        total["outputTokens"] += int(usage.get("outputTokens", 0))
        total["cost"] = round(total["cost"] + float(usage.get("cost", 0.0)), 8)
        row = {
            "step": ctx.sequence,
            "name": ctx.step_name,
            "model": answer.get("model", state["model"]),
            "inputTokens": int(usage.get("inputTokens", 0)),
            "outputTokens": int(usage.get("outputTokens", 0)),
        }
        total["perStep"] = [*total["perStep"], row][-MAX_FACTS:]
        ctx.summary = {"modelCall": row, "toolCalls": [c["name"] for c in answer.get("toolCalls", [])]}
        if usage.get("cost"):
            ctx.report_cost(float(usage["cost"]))  # charged to the task's maxCost

    @staticmethod
    def _check(entries: list[dict[str, Any]], calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
        """(calls to carry out, problems). A call is usable when it names an offered tool and
        its arguments are a JSON object valid against that tool's schema."""
        by_name = {e["name"]: e for e in entries}
        usable, problems = [], []
        for call in calls:
            name, raw = call.get("name", ""), call.get("arguments")
            if name not in by_name:
                problems.append(f"{name!r} is not one of the offered tools")
                continue
            try:
                arguments = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError as exc:
                problems.append(f"the arguments of {name} are not JSON ({exc})")
                continue
            if not isinstance(arguments, dict):
                problems.append(f"the arguments of {name} are not a JSON object")
                continue
            try:
                validate(arguments, by_name[name]["parameters"], f"{name} arguments")
            except SchemaError as exc:
                problems.append(str(exc))
                continue
            usable.append({"name": name, "arguments": arguments})
        return usable, problems

    # --- act: carry out what the model asked for ----------------------------------------------

    def _act(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        by_name = {e["name"]: e for e in state["catalog"]}
        for i, call in enumerate(state["pending"]):
            entry, arguments = by_name[call["name"]], call["arguments"]
            if entry["kind"] == "plan":
                state["plan"] = self._merge_plan(state["plan"], arguments["steps"])
            elif entry["kind"] == "finish":
                state["answer"], state["done"] = arguments["answer"], True
            elif entry["kind"] == "ask":
                answer = ctx.ask(f"ask-{ctx.sequence}-{i + 1}", arguments["question"], {"type": "string"})
                self._fact(state, ctx, "ask_person", f"Q: {arguments['question'][:300]} A: {answer}")
            else:
                name, args = catalog.ledger_call(entry, arguments)
                if state.get("suspected") and not self._cleared(ctx, state, i, name, args):
                    self._fact(
                        state, ctx, entry["tool"], "not done: an approver refused it after a suspected prompt injection"
                    )
                    continue
                try:
                    result = ctx.tool(name, args)
                except ToolRejected as exc:  # the approver said no: the model hears it and plans around it
                    self._fact(state, ctx, entry["tool"], f"not done: {exc}")
                    continue
                self._fact(state, ctx, entry["tool"], result, artifact=f"step-{ctx.sequence}-call-{i + 1}.json")
        state["pending"] = []
        ctx.progress(self._progress(state), phase="acting", message=f"round {state['rounds']} carried out")
        return state

    @staticmethod
    def _cleared(ctx: StepContext, state: dict[str, Any], i: int, name: str, args: dict[str, Any]) -> bool:
        """After a suspected injection the next side-effecting call waits for an approver
        (every tool the model can call acts on the world). True: approved, and the
        suspicion is cleared; False: refused."""
        key = f"injection-{ctx.sequence}-{i + 1}"
        if key not in ctx.answers:
            suspect = state["suspected"]
            summary = json.dumps(args, sort_keys=True)[:300]
            raise InputNeeded(
                key,
                f"Text from {suspect['source']} (step {suspect['step']}) looks like a prompt "
                f"injection ({', '.join(suspect['reasons'])}). The model now asks for {name} with "
                f"{summary}. Approve?",
                {"enum": ["approve", "reject"]},
                kind="approval",
            )
        state["suspected"] = None
        return ctx.answers[key] == "approve"

    @staticmethod
    def _merge_plan(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Done steps are kept, whatever the model sends: work that happened stays on record."""
        done = [s for s in old if s["status"] == "done"]
        done_titles = {s["title"] for s in done}
        steps = list(done)
        for step in new:
            if step["title"] not in done_titles:
                steps.append(
                    {"id": step.get("id") or f"s{len(steps) + 1}", "title": step["title"], "status": step["status"]}
                )
        return steps

    def _fact(
        self, state: dict[str, Any], ctx: StepContext, source: str, result: Any, *, artifact: str | None = None
    ) -> None:
        text = result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True)
        fact: dict[str, Any] = {"step": ctx.sequence, "source": source}
        if artifact and len(text) > BIG_RESULT:
            fact["ref"] = ctx.artifact(artifact, text, "application/json")
            fact["summary"] = f"{text[:SUMMARY]}... ({len(text)} characters in all: see the artifact)"
        else:
            fact["summary"] = text[:BIG_RESULT]
        if source != "ask_person" and (reasons := screening.screen(text)):
            fact["suspect"] = reasons
            state["suspected"] = {"step": ctx.sequence, "source": source, "reasons": reasons}
            ctx.log("suspected prompt injection in a tool result", source=source, reasons=reasons)
            ctx.summary = {**ctx.summary, "suspectedInjection": {"source": source, "reasons": reasons}}
        state["facts"].append(fact)
        if len(state["facts"]) > MAX_FACTS:
            state["facts"].pop(0)
            state["factsDropped"] += 1

    @staticmethod
    def _progress(state: dict[str, Any]) -> float:
        plan = state["plan"]
        return 0.0 if not plan else 0.95 * sum(s["status"] in ("done", "skipped") for s in plan) / len(plan)

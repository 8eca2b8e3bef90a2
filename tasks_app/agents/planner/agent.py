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
from tasks_app.agents.base import Agent, InputNeeded, StepContext, ToolFailure, ToolRejected, register
from tasks_app.agents.planner import catalog, prompt, screening

MAX_FACTS = 200  # kept in the state; the prompt shows as many of the newest as fit
BIG_RESULT = 2000  # characters: a larger tool result goes to an artifact, its summary to the facts
SUMMARY = 600
# A model's tool call is carried out only within these bounds (else it is sent back as malformed):
# whatever the endpoint answers, it must fit the state, the checkpoint and the tool's request.
MAX_ARGUMENT_CHARS = 100_000
MAX_ARGUMENT_DEPTH = 32
MAX_ANSWER_CHARS = 100_000  # a longer final answer is cut (the model's max_output_tokens should prevent it)


def _unusable(arguments: dict[str, Any]) -> str | None:
    """Why parsed arguments cannot be carried out, or None: nested past MAX_ARGUMENT_DEPTH
    (schema validation and the checkpoint's JSON would recurse), larger than
    MAX_ARGUMENT_CHARS, or holding a NUL or a lone surrogate (which PostgreSQL's text and
    jsonb refuse: kept in the state, they would fail the step's commit, not the call)."""
    stack: list[tuple[Any, int]] = [(arguments, 1)]
    size = 0
    while stack:
        item, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            return f"nest deeper than {MAX_ARGUMENT_DEPTH} levels"
        if isinstance(item, dict):
            stack += [(k, depth) for k in item] + [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
        elif isinstance(item, str):
            size += len(item)
            if "\x00" in item:
                return "contain a NUL character"
            try:
                item.encode()
            except UnicodeEncodeError:
                return "contain a lone surrogate"
        else:
            size += 8
        if size > MAX_ARGUMENT_CHARS:
            return f"are longer than {MAX_ARGUMENT_CHARS} characters"
    return None


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

    def step_deadline(self, step_name: str) -> float | None:
        """Never shorter than one model call with all its retries may take as configured
        (timeouts, retries, backoff), so a slow endpoint is not taken for a stuck step;
        act steps may ask the injection classifier too."""
        from ledger_app import llm

        section = settings.RUNTIME["llm"]
        timeouts = []
        for name in llm.model_names():
            try:
                timeouts.append(llm.model_config(name).timeout_seconds)
            except llm.UnknownModel:
                continue
        attempts = int(section["retries"]) + 1
        call = attempts * max(timeouts, default=0.0) + float(section["backoff_seconds"]) * (2**attempts - 1)
        if step_name.startswith("think-"):
            return max(float(self.step_seconds), call + 60)
        return float(self.step_seconds) + (call if section.get("classifier") else 0.0)

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
        # A final answer given for the old goal (as text, or a finish not carried out yet,
        # e.g. from a model call that was in flight when the goal moved) answers what nobody
        # asks any more: the task is not done, the model is asked again. Tool calls stay
        # pending: an act step lost in a crash may have made some of them, and the ledger
        # replays those under their keys instead of calling twice.
        finishing = [c for c in state["pending"] if c["name"] == "finish"]
        if state["done"] or finishing:
            old = state["answer"] or finishing[0]["arguments"].get("answer", "")
            state["done"], state["answer"] = False, None
            state["pending"] = [c for c in state["pending"] if c["name"] != "finish"]
            state["notes"].append(
                f"Your final answer was given before the goal was adjusted and is not accepted: {str(old)[:500]}"
            )
        model = constraints.get("model")
        if model and model != state["model"]:
            self._switch(state, model, why=f"adjust_goal (plan version {state['planVersion']})")
        return state

    @staticmethod
    def _switch(state: dict[str, Any], to: str, *, why: str) -> None:
        """The task goes on on another model: recorded in the state, audited by the new
        model's first step, and that model's first answer must re-validate the plan."""
        switch = {"from": state["model"], "to": to, "planVersion": state["planVersion"], "why": why}
        state["models"].append({k: switch[k] for k in ("from", "to", "planVersion")})
        state["model"], state["switch"], state["revalidate"] = to, switch, True
        state["notes"].append(
            "You take this task over from another model. First re-validate the plan "
            "against the facts (update_plan), then go on."
        )

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
        self._notice_switch(ctx, state)
        args = {
            "model": state["model"],
            "system": prompt.SYSTEM,
            "prompt": prompt.render(state, limit=int(settings.RUNTIME["llm"]["max_context_chars"])),
            "tools": catalog.functions(state["catalog"]),
        }
        # This step's model call has a key per plan version (and per reconfiguration of its model).
        ctx.calls = (state["planVersion"] + 1000 * state.get("reconfigured", 0)) * 1000
        answer = ctx.tool("llm.chat", args)
        state["rounds"] += 1
        self._count(ctx, state, answer)
        calls, problems = self._check(state["catalog"], answer.get("toolCalls", []))
        if state.get("revalidate") and not problems:
            if any(c["name"] == "update_plan" for c in calls):
                state["revalidate"] = False
            else:
                problems = [
                    "you took this task over from another model: re-validate the plan against "
                    "the facts with update_plan first (other calls may follow it in the same answer)"
                ]
        if not calls and not problems:
            if answer.get("text", "").strip():  # a plain answer is the final one
                state["answer"], state["done"] = self._cut(answer["text"].strip()), True
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

    def _notice_switch(self, ctx: StepContext, state: dict[str, Any]) -> None:
        """Before a model call: the model this task names may be another one now than the one
        that answered last (its configuration changed while the task was paused or before a
        worker recovered it): that is a switch too. A switch is audited here, in the new
        model's first step."""
        from ledger_app import llm

        try:
            cfg = llm.model_config(state["model"])
        except llm.UnknownModel:
            return  # the model call fails with the reason
        endpoint = f"{cfg.provider} {cfg.model} at {cfg.base_url}"
        last = state.get("endpoint")
        if last and last != endpoint and not state.get("switch"):
            self._switch(state, state["model"], why=f"reconfigured: {last} -> {endpoint}")
            # The call asks afresh, under a key of its own: a stored answer of the old model
            # (a worker lost after it was stored) is not the new model's validation.
            state["reconfigured"] = state.get("reconfigured", 0) + 1
        state["endpoint"] = endpoint
        if switch := state.get("switch"):
            ctx.audit("model_switched", reason=f"{switch['from']} -> {switch['to']}: {switch['why']}"[:500], **switch)
            ctx.log("the task goes on on another model", **switch)
            state["switch"] = None

    @staticmethod
    def _cut(text: str) -> str:
        return text if len(text) <= MAX_ANSWER_CHARS else text[:MAX_ANSWER_CHARS] + " ... (cut)"

    def _count(self, ctx: StepContext, state: dict[str, Any], answer: dict[str, Any], classifier: bool = False) -> None:
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
        if classifier:
            row["purpose"] = "injection-classifier"
        total["perStep"] = [*total["perStep"], row][-MAX_FACTS:]
        if classifier:
            ctx.summary = {**ctx.summary, "classifierCalls": ctx.summary.get("classifierCalls", 0) + 1}
        else:
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
            if isinstance(raw, str) and len(raw) > MAX_ARGUMENT_CHARS:
                problems.append(f"the arguments of {name} are longer than {MAX_ARGUMENT_CHARS} characters")
                continue
            try:
                arguments = json.loads(raw) if isinstance(raw, str) else raw
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
                problems.append(f"the arguments of {name} are not JSON ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            if not isinstance(arguments, dict):
                problems.append(f"the arguments of {name} are not a JSON object")
                continue
            if why := _unusable(arguments):
                problems.append(f"the arguments of {name} {why}")
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
                state["answer"], state["done"] = self._cut(arguments["answer"]), True
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
        text = (
            result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True, ensure_ascii=False)
        )
        fact: dict[str, Any] = {"step": ctx.sequence, "source": source}
        if artifact and len(text) > BIG_RESULT:
            fact["ref"] = ctx.artifact(artifact, text, "application/json")
            fact["summary"] = f"{text[:SUMMARY]}... ({len(text)} characters in all: see the artifact)"
        else:
            fact["summary"] = text[:BIG_RESULT]
        if source != "ask_person" and (reasons := self._screen(ctx, state, result)):
            fact["suspect"] = reasons
            state["suspected"] = {"step": ctx.sequence, "source": source, "reasons": reasons}
            ctx.log("suspected prompt injection in a tool result", source=source, reasons=reasons)
            ctx.summary = {**ctx.summary, "suspectedInjection": {"source": source, "reasons": reasons}}
        state["facts"].append(fact)
        if len(state["facts"]) > MAX_FACTS:
            state["facts"].pop(0)
            state["factsDropped"] += 1

    def _screen(self, ctx: StepContext, state: dict[str, Any], result: Any) -> list[str]:
        """Heuristics first; what they let through goes to the classifier model, if one is
        configured (llm.classifier). A classifier that fails or answers unclearly counts as
        a suspicion: screening fails closed (an approver sees the next side effect)."""
        if reasons := screening.screen_result(result):
            return reasons
        classifier = settings.RUNTIME["llm"].get("classifier")
        if not classifier:
            return []
        text = result if isinstance(result, str) else screening.texts(result)
        limit = int(settings.RUNTIME["llm"]["max_context_chars"])
        try:
            answer = ctx.tool(
                "llm.chat",
                {
                    "model": classifier,
                    "system": screening.CLASSIFIER_SYSTEM,
                    "prompt": screening.classifier_prompt(text, limit),
                },
            )
        except ToolFailure as exc:
            ctx.log("the injection classifier failed; the text counts as suspect", error=str(exc)[:300])
            return ["classifier-failed"]
        self._count(ctx, state, answer, classifier=True)
        return screening.verdict(answer.get("text", ""))

    @staticmethod
    def _progress(state: dict[str, Any]) -> float:
        plan = state["plan"]
        return 0.0 if not plan else 0.95 * sum(s["status"] in ("done", "skipped") for s in plan) / len(plan)

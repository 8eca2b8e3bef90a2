"""Contract risk review over a corpus in the blob store, one bounded batch per step.

The agent is deliberately rule-based: every finding names the rule that produced it, and the
rule table (rules.py) is the whole of its judgement. All progress (cursor, counters, top risks)
lives in the structured state, so a task resumed from any checkpoint finishes with exactly
the result an uninterrupted run would have produced.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import time
from typing import Any

from runtime_site.blobstore import BlobNotFound
from tasks_app.agents.base import Agent, StepContext, ToolRejected, register
from tasks_app.agents.document_review.report import render_markdown
from tasks_app.agents.document_review.rules import (
    CATEGORIES,
    HIGH_AT,
    LEVELS,
    MAX_ERRORS,
    MEDIUM_AT,
    PAYMENT_MAX_DAYS,
    PENALTY_MAX_PERCENT,
    TOP_N,
    assess,
    rule_table,
)

_INT = {"type": "integer", "minimum": 0}
_COUNTS = {"type": "object", "additionalProperties": _INT}


def _is_expired(doc: dict[str, Any], as_of: str) -> bool:
    try:
        return dt.date.fromisoformat(str(doc["expiry_date"])) < dt.date.fromisoformat(as_of)
    except (KeyError, ValueError):
        return False  # no usable expiry date: treat as live rather than silently skipping it


@register
class DocumentReviewAgent(Agent):
    name = "document_review"
    description = (
        "Reviews a corpus of contracts in the blob store against an explicit risk rule table, "
        "batch by batch, and writes JSON and Markdown reports."
    )
    input_schema = {
        "type": "object",
        "properties": {
            "corpus": {"type": "string", "minLength": 1, "pattern": r"^[^/].*"},
            "batchSize": {"type": "integer", "minimum": 1, "maximum": 500, "default": 25},
            "limit": {"type": "integer", "minimum": 1},
            "excludeExpired": {"type": "boolean", "default": False},
            "focus": {"type": "array", "items": {"enum": list(CATEGORIES)}, "minItems": 1, "uniqueItems": True},
            # Slows each batch down, for demos and steering tests that need a run to watch.
            "pacingMs": {"type": "integer", "minimum": 0, "maximum": 60_000, "default": 0},
            # End by publishing the report (content.publish) and mailing a summary (email.send);
            # both are guarded by approval in the default policy.
            "publish": {"type": "boolean", "default": False},
            "notify": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 50},
        },
        "required": ["corpus"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {
            "documentsTotal": _INT,
            "documentsReviewed": _INT,
            "skipped": _INT,
            "unreadable": _INT,
            "expired": _INT,
            "byLevel": {
                "type": "object",
                "properties": dict.fromkeys(LEVELS, _INT),
                "required": list(LEVELS),
                "additionalProperties": False,
            },
            "byCategory": {"type": "object", "propertyNames": {"enum": list(CATEGORIES)}, "additionalProperties": _INT},
            "byContractType": _COUNTS,
            "highRiskAmount": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
            "topRisks": {
                "type": "array",
                "maxItems": TOP_N,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "title": {"type": "string"},
                        "contractType": {"type": "string"},
                        "score": _INT,
                        "level": {"enum": list(LEVELS)},
                        "rules": {"type": "array", "items": {"type": "string"}},
                        "categories": {"type": "array", "items": {"enum": list(CATEGORIES)}},
                    },
                    "required": ["id", "score", "level", "rules"],
                    "additionalProperties": False,
                },
            },
            "report": {
                "type": "object",
                "properties": {"json": {"type": "string"}, "markdown": {"type": "string"}},
                "required": ["json", "markdown"],
                "additionalProperties": False,
            },
            "published": {"type": ["object", "null"]},
            "notified": {"type": ["object", "null"]},
        },
        "required": ["documentsReviewed", "byLevel", "byCategory", "expired", "topRisks", "report"],
        "additionalProperties": False,
    }

    # Re-aiming mid-run (steering adjust_goal): the remaining documents follow the new constraints.
    constraints_schema = {
        "type": "object",
        "properties": {
            "excludeExpired": {"type": "boolean"},
            "focus": {"type": "array", "items": {"enum": list(CATEGORIES)}, "minItems": 1, "uniqueItems": True},
        },
        "additionalProperties": False,
    }

    # -- lifecycle --

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        focus = input.get("focus")
        categories = [c for c in CATEGORIES if focus is None or c in focus]
        return {
            "stage": "load_manifest",
            "corpus": input["corpus"].strip("/"),
            "batchSize": input.get("batchSize", 25),
            "limit": input.get("limit"),
            "excludeExpired": input.get("excludeExpired", False),
            "focus": categories if focus is not None else None,
            "pacingMs": input.get("pacingMs", 0),
            "publish": input.get("publish", False),
            "notify": input.get("notify", []),
            "published": None,
            "notified": None,
            "asOf": None,
            "total": 0,
            "keys": None,  # only filled when manifest keys do not follow the standard layout
            "cursor": 0,
            "batch": 0,
            "counts": {
                "reviewed": 0,
                "skipped": 0,
                "expired": 0,
                "unreadable": 0,
                "byLevel": dict.fromkeys(LEVELS, 0),
                "byCategory": dict.fromkeys(categories, 0),
                "byContractType": {},
                "highRiskAmount": {},
            },
            "topRisks": [],
            "errors": [],
            "report": None,
        }

    def replan(self, state: dict[str, Any], goal: str, constraints: dict[str, Any]) -> dict[str, Any]:
        """Documents already reviewed keep their findings; the rest follow the new constraints
        (e.g. "prioritise compliance risk, exclude expired contracts")."""
        state = copy.deepcopy(state)
        if "excludeExpired" in constraints:
            state["excludeExpired"] = constraints["excludeExpired"]
        if "focus" in constraints:
            state["focus"] = [c for c in CATEGORIES if c in constraints["focus"]]
            for category in state["focus"]:
                state["counts"]["byCategory"].setdefault(category, 0)
        return state

    def next_step(self, state: dict[str, Any]) -> str | None:
        stage = state["stage"]
        if stage == "review":
            return f"review_batch_{state['batch'] + 1}"
        return None if stage == "done" else stage

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        # Work on a copy: the caller's state is the last checkpoint and must stay untouched
        # so that a failed or retried step starts from exactly the same place.
        state = copy.deepcopy(state)
        stage = state["stage"]
        if stage == "load_manifest":
            return self._load_manifest(ctx, state)
        if stage == "review":
            return self._review_batch(ctx, state)
        if stage == "write_report":
            return self._write_report(ctx, state)
        if stage == "publish_report":
            return self._publish(ctx, state)
        if stage == "notify":
            return self._notify(ctx, state)
        raise RuntimeError(f"document_review: no step to run in stage {stage!r}")

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        counts = state["counts"]
        return {
            "documentsTotal": state["total"],
            "documentsReviewed": counts["reviewed"],
            "skipped": counts["skipped"],
            "unreadable": counts["unreadable"],
            "expired": counts["expired"],
            "byLevel": dict(counts["byLevel"]),
            "byCategory": dict(counts["byCategory"]),
            "byContractType": dict(sorted(counts["byContractType"].items())),
            "highRiskAmount": dict(sorted(counts["highRiskAmount"].items())),
            "topRisks": [dict(t) for t in state["topRisks"]],
            "report": dict(state["report"] or {}),
            "published": state.get("published"),
            "notified": state.get("notified"),
        }

    # -- steps --

    def _load_manifest(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        key = f"{state['corpus']}/manifest.json"
        try:
            manifest = json.loads(ctx.read_blob(key))
        except BlobNotFound:
            raise ValueError(f"corpus manifest {key!r} not found; generate it with manage.py generate_corpus") from None
        keys = [str(k) for k in manifest.get("documents", [])]
        total = len(keys) if state["limit"] is None else min(len(keys), state["limit"])
        keys = keys[:total]
        # Standard layout keys are derivable from the index, so the checkpoint need not carry them.
        derivable = all(k == self._doc_key(state["corpus"], i) for i, k in enumerate(keys))
        state.update(
            asOf=str(manifest.get("asOf") or dt.datetime.now(dt.UTC).date().isoformat()),
            total=total,
            keys=None if derivable else keys,
            stage="review" if total else "write_report",
        )
        ctx.progress(0.0, phase="loading", message=f"manifest lists {len(keys)} documents, reviewing {total}")
        ctx.log("manifest loaded", corpus=state["corpus"], documents=total, asOf=state["asOf"])
        return state

    def _review_batch(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if state.get("pacingMs"):
            time.sleep(state["pacingMs"] / 1000)
        start = state["cursor"]
        end = min(start + state["batchSize"], state["total"])
        batch_levels = dict.fromkeys(LEVELS, 0)
        for index in range(start, end):
            level = self._review_one(ctx, state, index)
            if level is not None:
                batch_levels[level] += 1
        state["topRisks"] = sorted(state["topRisks"], key=lambda t: (-t["score"], t["id"]))[:TOP_N]
        state.update(cursor=end, batch=state["batch"] + 1)
        if end >= state["total"]:
            state["stage"] = "write_report"
        ctx.progress(end / state["total"], phase="risk_classification", message=f"reviewed {end} of {state['total']}")
        ctx.log("batch reviewed", batch=state["batch"], first=start + 1, last=end, **batch_levels)
        return state

    def _review_one(self, ctx: StepContext, state: dict[str, Any], index: int) -> str | None:
        counts = state["counts"]
        key = state["keys"][index] if state["keys"] is not None else self._doc_key(state["corpus"], index)
        try:
            doc = json.loads(ctx.read_blob(key))
            if not isinstance(doc, dict):
                raise ValueError("document is not a JSON object")
        except (BlobNotFound, ValueError) as exc:
            counts["unreadable"] += 1
            if len(state["errors"]) < MAX_ERRORS:
                state["errors"].append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
            ctx.log("document unreadable", key=key, error=str(exc))
            return None
        if _is_expired(doc, state["asOf"]):
            counts["expired"] += 1
            if state["excludeExpired"]:
                counts["skipped"] += 1
                return None
        found = assess(doc, state["focus"])
        counts["reviewed"] += 1
        counts["byLevel"][found.level] += 1
        for category in found.categories:
            counts["byCategory"][category] += 1
        kind = str(doc.get("contract_type", "unknown"))
        counts["byContractType"][kind] = counts["byContractType"].get(kind, 0) + 1
        amount = doc.get("amount")
        if found.level == "high" and isinstance(amount, int | float) and not isinstance(amount, bool) and amount >= 0:
            currency = str(doc.get("currency", "???"))
            counts["highRiskAmount"][currency] = counts["highRiskAmount"].get(currency, 0) + amount
        if found.score > 0:
            state["topRisks"].append(
                {
                    "id": str(doc.get("id", key)),
                    "title": str(doc.get("title", "")),
                    "contractType": kind,
                    "score": found.score,
                    "level": found.level,
                    "rules": found.rules,
                    "categories": found.categories,
                }
            )
        return found.level

    def _write_report(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        summary = self.result({**state, "report": {"json": "", "markdown": ""}})
        del summary["report"]
        report = {
            "corpus": state["corpus"],
            "asOf": state["asOf"],
            "parameters": {k: state[k] for k in ("batchSize", "limit", "excludeExpired", "focus")},
            "thresholds": {
                "medium": MEDIUM_AT,
                "high": HIGH_AT,
                "penaltyMaxPercent": PENALTY_MAX_PERCENT,
                "paymentMaxDays": PAYMENT_MAX_DAYS,
            },
            "rules": rule_table(),
            "summary": summary,
            "errors": state["errors"],
        }
        json_ref = ctx.artifact("report.json", json.dumps(report, indent=2), "application/json")
        md_ref = ctx.artifact("report.md", render_markdown(report), "text/markdown")
        state.update(report={"json": json_ref, "markdown": md_ref}, stage=self._after("write_report", state))
        ctx.progress(1.0, phase="reporting", message="report written")
        ctx.log("report written", json=json_ref, markdown=md_ref)
        return state

    @staticmethod
    def _after(stage: str, state: dict[str, Any]) -> str:
        order = ["write_report", "publish_report", "notify", "done"]
        wanted = {"publish_report": state.get("publish"), "notify": bool(state.get("notify")), "done": True}
        return next(s for s in order[order.index(stage) + 1 :] if wanted[s])

    def _publish(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        try:
            published = ctx.tool(
                "content.publish",
                {"source": state["report"]["markdown"], "name": "report.md", "contentType": "text/markdown"},
            )
            state["published"] = {"ref": published["ref"]}
            ctx.log("report published", ref=published["ref"])
        except ToolRejected as exc:  # the rejection path: keep the report unpublished
            state["published"] = {"rejected": str(exc)}
            ctx.log("publishing rejected", reason=str(exc))
        state["stage"] = self._after("publish_report", state)
        return state

    def _notify(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        counts = state["counts"]
        body = (
            f"Reviewed {counts['reviewed']} of {state['total']} contracts: {counts['byLevel']['high']} high, "
            f"{counts['byLevel']['medium']} medium, {counts['byLevel']['low']} low risk.\n"
            f"Report: {(state.get('published') or {}).get('ref') or state['report']['markdown']}\n"
        )
        try:
            ctx.tool(
                "email.send",
                {"to": state["notify"], "subject": f"Contract risk review: {state['corpus']}", "body": body},
            )
            state["notified"] = {"to": state["notify"]}
        except ToolRejected as exc:
            state["notified"] = {"rejected": str(exc)}
        state["stage"] = "done"
        return state

    @staticmethod
    def _doc_key(corpus: str, index: int) -> str:
        return f"{corpus}/docs/doc-{index + 1:05d}.json"

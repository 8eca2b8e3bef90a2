"""Contract risk review over a corpus in the blob store, one bounded batch per step.

The agent is deliberately rule-based: every finding names the rule that produced it, and the
rule table below is the whole of its judgement. All progress (cursor, counters, top risks)
lives in the structured state, so a task resumed from any checkpoint finishes with exactly
the result an uninterrupted run would have produced.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from runtime_site.blobstore import BlobNotFound
from tasks_app.agents.base import Agent, StepContext, ToolRejected, register

# --- the rule table ----------------------------------------------------------------------

CATEGORIES: tuple[str, ...] = (
    "unlimited_liability",
    "uncapped_indemnity",
    "unilateral_termination",
    "excessive_penalty",
    "missing_data_protection",
    "auto_renewal",
    "long_payment_terms",
    "exclusivity",
    "unusual_jurisdiction",
)
LEVELS: tuple[str, ...] = ("low", "medium", "high")
MEDIUM_AT, HIGH_AT = 3, 6  # score thresholds
TOP_N = 20
MAX_ERRORS = 20
PENALTY_MAX_PERCENT = 10.0  # liquidated damages / fees above this share of value are flagged
PAYMENT_MAX_DAYS = 90

# Governing laws the legal team is comfortable with; anything else is "unusual". Matching an
# allow-list (rather than a deny-list) means an unseen offshore jurisdiction is still flagged.
APPROVED_GOVERNING_LAWS = frozenset({
    "England and Wales", "Scotland", "Ireland", "State of New York", "State of Delaware", "Germany",
    "France", "Netherlands", "Switzerland", "Singapore", "Province of Ontario", "Sweden",
})

_I = re.IGNORECASE


@dataclass(frozen=True)
class Clause:
    heading: str
    text: str
    lower: str
    sentences: tuple[str, ...]


_SENTENCE_SPLIT = re.compile(r"(?<=[.;])\s+(?=[A-Z(])")


def prepare(doc: dict[str, Any]) -> tuple[Clause, ...]:
    """Split each clause into sentences once, so every rule sees the same view."""
    clauses = []
    for raw in doc.get("clauses") or []:
        if not isinstance(raw, dict):  # malformed entry: nothing a rule could read
            continue
        heading, text = str(raw.get("heading", "")), str(raw.get("text", ""))
        clauses.append(Clause(heading, text, text.lower(), tuple(_SENTENCE_SPLIT.split(text))))
    return tuple(clauses)


Predicate = Callable[[tuple[Clause, ...]], bool]


@dataclass(frozen=True)
class Rule:
    name: str
    category: str
    weight: int
    description: str
    matches: Predicate


def _gated(clauses: tuple[Clause, ...], words: tuple[str, ...],
           heading: re.Pattern[str] | None = None) -> Iterator[Clause]:
    """Clauses containing at least one of ``words`` (lower-case), under a matching heading.

    Regex search dominates review time, and a substring test is ~100x cheaper, so each rule
    names words that any match must contain and the regex only runs where they occur. The
    words are a necessary condition only: they never flag anything by themselves.
    """
    for clause in clauses:
        if any(w in clause.lower for w in words) and (heading is None or heading.search(clause.heading)):
            yield clause


def sentence_rule(pattern: str, *, words: tuple[str, ...], also: str | None = None, unless: str | None = None,
                  heading: str | None = None, flags: int = _I) -> Predicate:
    """Some sentence (optionally only in clauses whose heading matches) matches ``pattern``
    and ``also``, and does not match ``unless``."""
    rx, also_rx = re.compile(pattern, flags), re.compile(also, _I) if also else None
    unless_rx = re.compile(unless, _I) if unless else None
    heading_rx = re.compile(heading, _I) if heading else None

    def test(clauses: tuple[Clause, ...]) -> bool:
        return any(
            rx.search(s) and (also_rx is None or also_rx.search(s)) and not (unless_rx and unless_rx.search(s))
            for c in _gated(clauses, words, heading_rx) for s in c.sentences)
    return test


def clause_rule(*patterns: str, words: tuple[str, ...], heading: str | None = None) -> Predicate:
    """Some clause (optionally only where the heading matches) matches every pattern, in any sentence."""
    rxs = [re.compile(p, _I) for p in patterns]
    heading_rx = re.compile(heading, _I) if heading else None

    def test(clauses: tuple[Clause, ...]) -> bool:
        return any(all(rx.search(c.text) for rx in rxs) for c in _gated(clauses, words, heading_rx))
    return test


_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*(?:%|per\s?cent\b|percent\b)", _I)
_PENALTY_WORDS = re.compile(
    r"liquidated damages|penalt(?:y|ies)|\b(?:break|cancellation|early termination|prepayment) fee", _I)


def excessive_penalty(clauses: tuple[Clause, ...]) -> bool:
    # Percentages are read per sentence so an interest rate elsewhere never counts as a penalty.
    return any(_PENALTY_WORDS.search(s) and any(float(p) > PENALTY_MAX_PERCENT for p in _PERCENT.findall(s))
               for c in _gated(clauses, ("liquidated damages", "penalt", " fee")) for s in c.sentences)


_PAYMENT_WORDS = re.compile(r"\b(?:pay|paid|payable|payment|invoices?)\b|\bnet\s*\d", _I)
_DAY_COUNT = re.compile(r"(\d+)\)?\s*(?:calendar\s+|business\s+|working\s+)?days?\b|\bnet\s*(\d+)\b", _I)


def long_payment_terms(clauses: tuple[Clause, ...]) -> bool:
    return any(_PAYMENT_WORDS.search(s) and any(int(a or b) > PAYMENT_MAX_DAYS for a, b in _DAY_COUNT.findall(s))
               for c in _gated(clauses, ("pay", "paid", "invoice", "net")) for s in c.sentences)


_GOVERNS = re.compile(r"\bgovern|\bconstrued\b", _I)
# Case-sensitive on purpose: a jurisdiction is a run of capitalised words ("England and Wales",
# "State of New York") and the first lower-case word ("govern", "and the courts") ends it.
_LAW_OF = re.compile(r"\b[Ll]aws? of (?:the )?([A-Z][A-Za-z]+(?:(?: and| of)? [A-Z][A-Za-z]+)*)")


def unusual_governing_law(clauses: tuple[Clause, ...]) -> bool:
    return any(name not in APPROVED_GOVERNING_LAWS
               for c in _gated(clauses, ("govern", "construed")) for s in c.sentences if _GOVERNS.search(s)
               for name in _LAW_OF.findall(s))


_PERSONAL_DATA_WORDS = ("personal data", "personal information", "personally identifiable", "pii")
_PERSONAL_DATA = re.compile(r"personal (?:data|information)|personally identifiable information|\bPII\b", _I)
_DATA_PROTECTION = re.compile(
    r"data protection (?:laws?|legislation)|\bGDPR\b|General Data Protection Regulation"
    r"|data processing (?:agreement|addendum)", _I)


def missing_data_protection(clauses: tuple[Clause, ...]) -> bool:
    # Whole-document rule: personal data anywhere, and a data-protection clause nowhere.
    if not any(_PERSONAL_DATA.search(c.text) for c in _gated(clauses, _PERSONAL_DATA_WORDS)):
        return False
    return not any(_DATA_PROTECTION.search(c.text) for c in clauses)


_LIABILITY_HEADING = r"liabilit"
_INDEMNITY_HEADING = r"indemn"
# "The Supplier may ... terminate" — any defined party except the Company itself (or both parties).
_COUNTERPARTY_TERMINATES = (
    r"\b[Tt]he (?!Company\b|Parties\b|Party\b)[A-Z][a-z]+(?: [A-Z][a-z]+)? "
    r"(?:may|shall be entitled to|reserves the right to|has the right to)\b[^.]{0,60}?\bterminate")
_AUTO_RENEW = (r"\b(?:automatically|tacitly)\s+(?:be\s+)?(?:renew|extend)\w*|\b(?:renew|extend)\w*\s+automatically"
               r"|\bauto-renew\w*|\bevergreen\b")

RULES: tuple[Rule, ...] = (
    Rule("liability.unlimited_wording", "unlimited_liability", 4,
         "Liability clause says the Company's liability is unlimited / without limitation / not capped.",
         sentence_rule(r"\bliab\w*\b[^.]{0,80}?(?:\bunlimited\b|(?<!including )\bwithout limitation\b"
                       r"|\bnot be subject to any (?:financial )?(?:cap|limit))", heading=_LIABILITY_HEADING,
                       words=("unlimited", "without limitation", "not be subject to any"))),
    Rule("liability.no_cap", "unlimited_liability", 4,
         "Liability clause states there is no cap on liability.",
         sentence_rule(r"\bno (?:cap|limit)\w* on\b[^.]{0,40}\bliabilit", heading=_LIABILITY_HEADING,
                       words=("no cap", "no limit"))),
    Rule("indemnity.company_uncapped", "uncapped_indemnity", 4,
         "The Company gives an indemnity that is expressly uncapped or outside the liability cap.",
         clause_rule(r"\bthe Company (?:shall|will|agrees to|undertakes to)\s+(?:fully\s+)?"
                     r"(?:indemnify|keep\b[^.]{0,40}\bindemnified)",
                     r"without limitation as to amount|not be subject to any (?:cap|limit)|\buncapped\b"
                     r"|\bunlimited\b|shall not apply to (?:this|such|the) indemnit",
                     heading=_INDEMNITY_HEADING,
                     words=("without limitation as to amount", "not be subject to any", "uncapped", "unlimited",
                            "shall not apply to"))),
    Rule("termination.counterparty_convenience", "unilateral_termination", 3,
         "The counterparty may terminate for convenience / without cause / at its discretion.",
         sentence_rule(_COUNTERPARTY_TERMINATES, flags=0,
                       also=r"for convenience|without cause|\b(?:its|their) (?:sole|absolute) discretion"
                            r"|for any reason",
                       words=("for convenience", "without cause", "discretion", "for any reason"))),
    Rule("penalty.above_threshold", "excessive_penalty", 3,
         f"Liquidated damages, penalty or break/cancellation fee above {PENALTY_MAX_PERCENT:g}% of value.",
         excessive_penalty),
    Rule("data_protection.missing", "missing_data_protection", 3,
         "Contract involves personal data but has no data-protection / DPA clause.",
         missing_data_protection),
    Rule("renewal.automatic_without_notice", "auto_renewal", 2,
         "Contract renews automatically with no advance notice of the renewal to the Company.",
         sentence_rule(_AUTO_RENEW,
                       unless=r"\b(?:shall|will) not (?:be )?(?:automatically |tacitly )?(?:renew|extend)"
                              r"|notice of (?:the |any )?(?:upcoming|forthcoming|impending|proposed) renewal"
                              r"|renewal reminder|\bopt(?:ed|s)?[- ]out\b",
                       words=("automatically", "tacitly", "auto-renew", "evergreen"))),
    Rule("payment.terms_over_90_days", "long_payment_terms", 2,
         f"Payment terms longer than {PAYMENT_MAX_DAYS} days.", long_payment_terms),
    Rule("exclusivity.express", "exclusivity", 2,
         "Express exclusivity (ignoring non-exclusive, exclusive jurisdiction/remedy/property, exclusive of VAT).",
         sentence_rule(r"(?<!non-)(?<!non )\bexclusiv(?:e|ely|ity)\b"
                       r"(?!\s+(?:of\b|jurisdiction\b|remed(?:y|ies)\b|property\b))", words=("exclusiv",))),
    Rule("exclusivity.no_other_suppliers", "exclusivity", 2,
         "The Company may not source the same goods or services from anyone else.",
         sentence_rule(r"\bshall not (?:procure|purchase|obtain|source)\b[^.]{0,80}?\bfrom any (?:other|third)",
                       words=("shall not",))),
    Rule("jurisdiction.unusual_governing_law", "unusual_jurisdiction", 2,
         "Governing law outside the approved list.", unusual_governing_law),
)
assert {r.category for r in RULES} == set(CATEGORIES)


@dataclass(frozen=True)
class Assessment:
    score: int
    level: str
    rules: list[str]
    categories: list[str]


def level_for(score: int) -> str:
    return "high" if score >= HIGH_AT else "medium" if score >= MEDIUM_AT else "low"


def assess(doc: dict[str, Any], focus: list[str] | None = None) -> Assessment:
    """Run the rule table. A category counts once, at the weight of its strongest matching rule."""
    clauses = prepare(doc)
    matched = [r for r in RULES if (focus is None or r.category in focus) and r.matches(clauses)]
    weights: dict[str, int] = {}
    for rule in matched:
        weights[rule.category] = max(weights.get(rule.category, 0), rule.weight)
    score = sum(weights.values())
    categories = [c for c in CATEGORIES if c in weights]
    return Assessment(score, level_for(score), [r.name for r in matched], categories)


def rule_table() -> list[dict[str, Any]]:
    return [{"name": r.name, "category": r.category, "weight": r.weight, "description": r.description}
            for r in RULES]


# --- the agent -----------------------------------------------------------------------------

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
    description = ("Reviews a corpus of contracts in the blob store against an explicit risk rule table, "
                   "batch by batch, and writes JSON and Markdown reports.")
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
            "byCategory": {"type": "object", "propertyNames": {"enum": list(CATEGORIES)},
                           "additionalProperties": _INT},
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
                "reviewed": 0, "skipped": 0, "expired": 0, "unreadable": 0,
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
        state.update(asOf=str(manifest.get("asOf") or dt.datetime.now(dt.UTC).date().isoformat()), total=total,
                     keys=None if derivable else keys, stage="review" if total else "write_report")
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
        ctx.progress(end / state["total"], phase="risk_classification",
                     message=f"reviewed {end} of {state['total']}")
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
            state["topRisks"].append({
                "id": str(doc.get("id", key)), "title": str(doc.get("title", "")), "contractType": kind,
                "score": found.score, "level": found.level, "rules": found.rules, "categories": found.categories,
            })
        return found.level

    def _write_report(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        summary = self.result({**state, "report": {"json": "", "markdown": ""}})
        del summary["report"]
        report = {
            "corpus": state["corpus"], "asOf": state["asOf"],
            "parameters": {k: state[k] for k in ("batchSize", "limit", "excludeExpired", "focus")},
            "thresholds": {"medium": MEDIUM_AT, "high": HIGH_AT, "penaltyMaxPercent": PENALTY_MAX_PERCENT,
                           "paymentMaxDays": PAYMENT_MAX_DAYS},
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
        return next(s for s in order[order.index(stage) + 1:] if wanted[s])

    def _publish(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        try:
            published = ctx.tool("content.publish", {"source": state["report"]["markdown"], "name": "report.md",
                                                     "contentType": "text/markdown"})
            state["published"] = {"ref": published["ref"]}
            ctx.log("report published", ref=published["ref"])
        except ToolRejected as exc:  # the rejection path: keep the report unpublished
            state["published"] = {"rejected": str(exc)}
            ctx.log("publishing rejected", reason=str(exc))
        state["stage"] = self._after("publish_report", state)
        return state

    def _notify(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        counts = state["counts"]
        body = (f"Reviewed {counts['reviewed']} of {state['total']} contracts: {counts['byLevel']['high']} high, "
                f"{counts['byLevel']['medium']} medium, {counts['byLevel']['low']} low risk.\n"
                f"Report: {(state.get('published') or {}).get('ref') or state['report']['markdown']}\n")
        try:
            ctx.tool("email.send", {"to": state["notify"], "subject": f"Contract risk review: {state['corpus']}",
                                    "body": body})
            state["notified"] = {"to": state["notify"]}
        except ToolRejected as exc:
            state["notified"] = {"rejected": str(exc)}
        state["stage"] = "done"
        return state

    @staticmethod
    def _doc_key(corpus: str, index: int) -> str:
        return f"{corpus}/docs/doc-{index + 1:05d}.json"


# --- markdown rendering --------------------------------------------------------------------

def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    reviewed = s["documentsReviewed"] or 1  # avoid dividing by zero in percentages
    params = report["parameters"]
    parts = [
        f"# Contract risk review: `{report['corpus']}`",
        f"As of **{report['asOf']}**. {s['documentsTotal']} documents in scope, **{s['documentsReviewed']} reviewed**, "
        f"{s['skipped']} skipped (expired, excludeExpired={str(params['excludeExpired']).lower()}), "
        f"{s['unreadable']} unreadable; {s['expired']} expired."
        + (f" Focus: {', '.join(params['focus'])}." if params["focus"] else ""),
        "## Risk levels",
        _table(["Level", "Documents", "Share"],
               [[lvl, n, f"{100 * n / reviewed:.1f}%"] for lvl, n in s["byLevel"].items()]),
        "## Risk categories",
        _table(["Category", "Documents", "Share"],
               [[cat, n, f"{100 * n / reviewed:.1f}%"]
                for cat, n in sorted(s["byCategory"].items(), key=lambda kv: (-kv[1], kv[0]))]),
        "## Contract types",
        _table(["Contract type", "Documents"], [[k, n] for k, n in s["byContractType"].items()]),
        "## Value at high risk",
        _table(["Currency", "Total amount"], [[cur, f"{amt:,.0f}"] for cur, amt in s["highRiskAmount"].items()])
        if s["highRiskAmount"] else "_No high-risk documents carry a value._",
        f"## Top {len(s['topRisks'])} risks",
        _table(["#", "Document", "Type", "Score", "Level", "Rules"],
               [[i, f"{t['id']} — {t['title']}", t["contractType"], t["score"], t["level"], ", ".join(t["rules"])]
                for i, t in enumerate(s["topRisks"], start=1)]),
        "## Rules",
        f"Levels: low < {report['thresholds']['medium']} ≤ medium < {report['thresholds']['high']} ≤ high. "
        "A category scores once, at the weight of its strongest matching rule.",
        _table(["Rule", "Category", "Weight", "What it flags"],
               [[r["name"], r["category"], r["weight"], r["description"]] for r in report["rules"]]),
    ]
    return "\n\n".join(parts) + "\n"

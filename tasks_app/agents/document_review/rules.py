"""The rule table: the whole of the document_review agent's judgement. Every finding names
the rule that produced it; assess() runs the table over one document."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
APPROVED_GOVERNING_LAWS = frozenset(
    {
        "England and Wales",
        "Scotland",
        "Ireland",
        "State of New York",
        "State of Delaware",
        "Germany",
        "France",
        "Netherlands",
        "Switzerland",
        "Singapore",
        "Province of Ontario",
        "Sweden",
    }
)

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


def _gated(
    clauses: tuple[Clause, ...], words: tuple[str, ...], heading: re.Pattern[str] | None = None
) -> Iterator[Clause]:
    """Clauses containing at least one of ``words`` (lower-case), under a matching heading.

    Regex search dominates review time, and a substring test is ~100x cheaper, so each rule
    names words that any match must contain and the regex only runs where they occur. The
    words are a necessary condition only: they never flag anything by themselves.
    """
    for clause in clauses:
        if any(w in clause.lower for w in words) and (heading is None or heading.search(clause.heading)):
            yield clause


def sentence_rule(
    pattern: str,
    *,
    words: tuple[str, ...],
    also: str | None = None,
    unless: str | None = None,
    heading: str | None = None,
    flags: int = _I,
) -> Predicate:
    """Some sentence (optionally only in clauses whose heading matches) matches ``pattern``
    and ``also``, and does not match ``unless``."""
    rx, also_rx = re.compile(pattern, flags), re.compile(also, _I) if also else None
    unless_rx = re.compile(unless, _I) if unless else None
    heading_rx = re.compile(heading, _I) if heading else None

    def test(clauses: tuple[Clause, ...]) -> bool:
        return any(
            rx.search(s) and (also_rx is None or also_rx.search(s)) and not (unless_rx and unless_rx.search(s))
            for c in _gated(clauses, words, heading_rx)
            for s in c.sentences
        )

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
    r"liquidated damages|penalt(?:y|ies)|\b(?:break|cancellation|early termination|prepayment) fee", _I
)


def excessive_penalty(clauses: tuple[Clause, ...]) -> bool:
    # Percentages are read per sentence so an interest rate elsewhere never counts as a penalty.
    return any(
        _PENALTY_WORDS.search(s) and any(float(p) > PENALTY_MAX_PERCENT for p in _PERCENT.findall(s))
        for c in _gated(clauses, ("liquidated damages", "penalt", " fee"))
        for s in c.sentences
    )


_PAYMENT_WORDS = re.compile(r"\b(?:pay|paid|payable|payment|invoices?)\b|\bnet\s*\d", _I)
_DAY_COUNT = re.compile(r"(\d+)\)?\s*(?:calendar\s+|business\s+|working\s+)?days?\b|\bnet\s*(\d+)\b", _I)


def long_payment_terms(clauses: tuple[Clause, ...]) -> bool:
    return any(
        _PAYMENT_WORDS.search(s) and any(int(a or b) > PAYMENT_MAX_DAYS for a, b in _DAY_COUNT.findall(s))
        for c in _gated(clauses, ("pay", "paid", "invoice", "net"))
        for s in c.sentences
    )


_GOVERNS = re.compile(r"\bgovern|\bconstrued\b", _I)
# Case-sensitive on purpose: a jurisdiction is a run of capitalised words ("England and Wales",
# "State of New York") and the first lower-case word ("govern", "and the courts") ends it.
_LAW_OF = re.compile(r"\b[Ll]aws? of (?:the )?([A-Z][A-Za-z]+(?:(?: and| of)? [A-Z][A-Za-z]+)*)")


def unusual_governing_law(clauses: tuple[Clause, ...]) -> bool:
    return any(
        name not in APPROVED_GOVERNING_LAWS
        for c in _gated(clauses, ("govern", "construed"))
        for s in c.sentences
        if _GOVERNS.search(s)
        for name in _LAW_OF.findall(s)
    )


_PERSONAL_DATA_WORDS = ("personal data", "personal information", "personally identifiable", "pii")
_PERSONAL_DATA = re.compile(r"personal (?:data|information)|personally identifiable information|\bPII\b", _I)
_DATA_PROTECTION = re.compile(
    r"data protection (?:laws?|legislation)|\bGDPR\b|General Data Protection Regulation"
    r"|data processing (?:agreement|addendum)",
    _I,
)


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
    r"(?:may|shall be entitled to|reserves the right to|has the right to)\b[^.]{0,60}?\bterminate"
)
_AUTO_RENEW = (
    r"\b(?:automatically|tacitly)\s+(?:be\s+)?(?:renew|extend)\w*|\b(?:renew|extend)\w*\s+automatically"
    r"|\bauto-renew\w*|\bevergreen\b"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "liability.unlimited_wording",
        "unlimited_liability",
        4,
        "Liability clause says the Company's liability is unlimited / without limitation / not capped.",
        sentence_rule(
            r"\bliab\w*\b[^.]{0,80}?(?:\bunlimited\b|(?<!including )\bwithout limitation\b"
            r"|\bnot be subject to any (?:financial )?(?:cap|limit))",
            heading=_LIABILITY_HEADING,
            words=("unlimited", "without limitation", "not be subject to any"),
        ),
    ),
    Rule(
        "liability.no_cap",
        "unlimited_liability",
        4,
        "Liability clause states there is no cap on liability.",
        sentence_rule(
            r"\bno (?:cap|limit)\w* on\b[^.]{0,40}\bliabilit", heading=_LIABILITY_HEADING, words=("no cap", "no limit")
        ),
    ),
    Rule(
        "indemnity.company_uncapped",
        "uncapped_indemnity",
        4,
        "The Company gives an indemnity that is expressly uncapped or outside the liability cap.",
        clause_rule(
            r"\bthe Company (?:shall|will|agrees to|undertakes to)\s+(?:fully\s+)?"
            r"(?:indemnify|keep\b[^.]{0,40}\bindemnified)",
            r"without limitation as to amount|not be subject to any (?:cap|limit)|\buncapped\b"
            r"|\bunlimited\b|shall not apply to (?:this|such|the) indemnit",
            heading=_INDEMNITY_HEADING,
            words=(
                "without limitation as to amount",
                "not be subject to any",
                "uncapped",
                "unlimited",
                "shall not apply to",
            ),
        ),
    ),
    Rule(
        "termination.counterparty_convenience",
        "unilateral_termination",
        3,
        "The counterparty may terminate for convenience / without cause / at its discretion.",
        sentence_rule(
            _COUNTERPARTY_TERMINATES,
            flags=0,
            also=r"for convenience|without cause|\b(?:its|their) (?:sole|absolute) discretion"
            r"|for any reason",
            words=("for convenience", "without cause", "discretion", "for any reason"),
        ),
    ),
    Rule(
        "penalty.above_threshold",
        "excessive_penalty",
        3,
        f"Liquidated damages, penalty or break/cancellation fee above {PENALTY_MAX_PERCENT:g}% of value.",
        excessive_penalty,
    ),
    Rule(
        "data_protection.missing",
        "missing_data_protection",
        3,
        "Contract involves personal data but has no data-protection / DPA clause.",
        missing_data_protection,
    ),
    Rule(
        "renewal.automatic_without_notice",
        "auto_renewal",
        2,
        "Contract renews automatically with no advance notice of the renewal to the Company.",
        sentence_rule(
            _AUTO_RENEW,
            unless=r"\b(?:shall|will) not (?:be )?(?:automatically |tacitly )?(?:renew|extend)"
            r"|notice of (?:the |any )?(?:upcoming|forthcoming|impending|proposed) renewal"
            r"|renewal reminder|\bopt(?:ed|s)?[- ]out\b",
            words=("automatically", "tacitly", "auto-renew", "evergreen"),
        ),
    ),
    Rule(
        "payment.terms_over_90_days",
        "long_payment_terms",
        2,
        f"Payment terms longer than {PAYMENT_MAX_DAYS} days.",
        long_payment_terms,
    ),
    Rule(
        "exclusivity.express",
        "exclusivity",
        2,
        "Express exclusivity (ignoring non-exclusive, exclusive jurisdiction/remedy/property, exclusive of VAT).",
        sentence_rule(
            r"(?<!non-)(?<!non )\bexclusiv(?:e|ely|ity)\b"
            r"(?!\s+(?:of\b|jurisdiction\b|remed(?:y|ies)\b|property\b))",
            words=("exclusiv",),
        ),
    ),
    Rule(
        "exclusivity.no_other_suppliers",
        "exclusivity",
        2,
        "The Company may not source the same goods or services from anyone else.",
        sentence_rule(
            r"\bshall not (?:procure|purchase|obtain|source)\b[^.]{0,80}?\bfrom any (?:other|third)",
            words=("shall not",),
        ),
    ),
    Rule(
        "jurisdiction.unusual_governing_law",
        "unusual_jurisdiction",
        2,
        "Governing law outside the approved list.",
        unusual_governing_law,
    ),
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
    return [{"name": r.name, "category": r.category, "weight": r.weight, "description": r.description} for r in RULES]

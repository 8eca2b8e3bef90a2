"""Deterministic generator of a synthetic corpus of contract-like documents.

The corpus exists to exercise the document_review agent at realistic scale. Every random
choice flows from one ``random.Random(seed)``, so the same (count, seed, as_of) always
produces byte-identical documents.

Risky clauses are *planted*: for each document the generator decides which risk factors it
carries and then writes the clause text from several phrasings. Those decisions are recorded
in ``truth.json`` straight from the generator, never by running the review rules, so tests
can check the agent's counts against an independent source. Benign documents deliberately
contain the usual look-alike boilerplate ("non-exclusive", "exclusive jurisdiction",
"including without limitation", "shall not renew automatically", 90-day payment terms ...)
so that naive keyword rules would over-count.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime_site.blobstore import BlobStore

DEFAULT_AS_OF = "2026-11-01"

# The risk factors the generator can plant. The review agent keeps its own list (it must not
# depend on test-data code); tests assert the two agree.
RISK_CATEGORIES: tuple[str, ...] = (
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

# How often each risk is planted when the contract type allows it.
RISK_RATES: dict[str, float] = {
    "unlimited_liability": 0.10,
    "uncapped_indemnity": 0.12,
    "unilateral_termination": 0.15,
    "excessive_penalty": 0.18,
    "auto_renewal": 0.22,
    "long_payment_terms": 0.15,
    "exclusivity": 0.15,
    "unusual_jurisdiction": 0.08,
}
# missing_data_protection is planted in two stages: does the contract handle personal data
# (a per-type rate), and if so is the data-protection clause left out.
MISSING_DP_RATE = 0.35

COMPANY = "Orbis Group Holdings Ltd"

# name -> currency. Names are written as they appear after "the laws of".
USUAL_JURISDICTIONS: dict[str, str] = {
    "England and Wales": "GBP",
    "Scotland": "GBP",
    "Ireland": "EUR",
    "the State of New York": "USD",
    "the State of Delaware": "USD",
    "Germany": "EUR",
    "France": "EUR",
    "the Netherlands": "EUR",
    "Switzerland": "CHF",
    "Singapore": "SGD",
    "the Province of Ontario": "CAD",
    "Sweden": "SEK",
}
UNUSUAL_JURISDICTIONS: tuple[str, ...] = (
    "the Cayman Islands",
    "the British Virgin Islands",
    "the Republic of Vanuatu",
    "the Marshall Islands",
    "Seychelles",
    "Belize",
    "the Republic of Nauru",
)

_NAME_HEADS = (
    "Northbridge",
    "Halcyon",
    "Kestrel",
    "Meridian",
    "Bluewater",
    "Ironbark",
    "Larkspur",
    "Silverline",
    "Ashdown",
    "Corvid",
    "Fenwick",
    "Granite Peak",
    "Harbourside",
    "Juniper",
    "Lodestar",
    "Marlowe",
    "Nettlefield",
    "Oakhurst",
    "Pinnacle",
    "Quayside",
    "Redfern",
    "Sable",
    "Thornbury",
    "Upland",
    "Vantage",
    "Westmark",
    "Yarrow",
    "Zephyr",
    "Brightwater",
    "Copperleaf",
    "Driftwood",
    "Elmstead",
    "Foxglove",
    "Greyfriars",
    "Hollis",
    "Ivory Tower",
)
_NAME_TAILS = (
    "Logistics",
    "Systems",
    "Components",
    "Analytics",
    "Facilities",
    "Software",
    "Engineering",
    "Consulting",
    "Manufacturing",
    "Properties",
    "Finance",
    "Data Services",
    "Packaging",
    "Industries",
    "Technologies",
    "Partners",
    "Holdings",
    "Solutions",
    "Materials",
    "Estates",
)
_NAME_SUFFIXES = ("Ltd", "Limited", "plc", "GmbH", "B.V.", "Inc.", "LLC", "S.A.", "AB", "Pte. Ltd.", "AG", "SAS")

_NUMBER_WORDS = {
    2: "two",
    3: "three",
    5: "five",
    10: "ten",
    12: "twelve",
    14: "fourteen",
    15: "fifteen",
    20: "twenty",
    25: "twenty-five",
    30: "thirty",
    45: "forty-five",
    60: "sixty",
    90: "ninety",
    105: "one hundred and five",
    120: "one hundred and twenty",
    150: "one hundred and fifty",
    180: "one hundred and eighty",
}


@dataclass(frozen=True)
class TypeSpec:
    titles: tuple[str, ...]
    role: str
    subject: str
    amount_range: tuple[int, int]
    term_months: tuple[int, ...]
    risks: frozenset[str]
    personal_data_rate: float
    weight: int  # relative frequency in the corpus


_ALL = frozenset(RISK_CATEGORIES)
CONTRACT_TYPES: dict[str, TypeSpec] = {
    "supply": TypeSpec(
        ("Master Supply Agreement", "Supply Agreement", "Framework Purchase Agreement"),
        "Supplier",
        "the Products",
        (50_000, 5_000_000),
        (12, 24, 36, 48),
        _ALL,
        0.10,
        5,
    ),
    "services": TypeSpec(
        ("Master Services Agreement", "Professional Services Agreement", "Managed Services Agreement"),
        "Service Provider",
        "the Services",
        (20_000, 2_000_000),
        (12, 24, 36),
        _ALL,
        0.60,
        5,
    ),
    "licence": TypeSpec(
        ("Software Licence Agreement", "Subscription and Licence Agreement", "Technology Licence Agreement"),
        "Licensor",
        "the Licensed Software",
        (10_000, 800_000),
        (12, 24, 36),
        _ALL - {"exclusivity"},
        0.50,
        4,
    ),
    "nda": TypeSpec(
        ("Mutual Non-Disclosure Agreement", "Confidentiality Agreement", "Non-Disclosure Agreement"),
        "Counterparty",
        "the Confidential Information",
        (0, 0),
        (12, 24, 36),
        frozenset(
            {
                "unlimited_liability",
                "uncapped_indemnity",
                "unilateral_termination",
                "missing_data_protection",
                "auto_renewal",
                "unusual_jurisdiction",
            }
        ),
        0.30,
        3,
    ),
    "lease": TypeSpec(
        ("Lease of Commercial Premises", "Office Lease", "Warehouse Lease Agreement"),
        "Landlord",
        "the Premises",
        (30_000, 1_500_000),
        (36, 60, 84),
        frozenset(
            {
                "unlimited_liability",
                "uncapped_indemnity",
                "unilateral_termination",
                "excessive_penalty",
                "auto_renewal",
                "unusual_jurisdiction",
            }
        ),
        0.0,
        2,
    ),
    "loan": TypeSpec(
        ("Facility Agreement", "Term Loan Agreement", "Revolving Credit Facility Agreement"),
        "Lender",
        "the Facility",
        (500_000, 25_000_000),
        (36, 48, 60, 84),
        frozenset({"uncapped_indemnity", "unilateral_termination", "excessive_penalty", "unusual_jurisdiction"}),
        0.0,
        2,
    ),
}


# --- small text helpers --------------------------------------------------------------------


def _days(rng: random.Random, n: int) -> str:
    """'ninety (90) days' or '90 days' — contracts write numbers both ways."""
    if n in _NUMBER_WORDS and rng.random() < 0.6:
        return f"{_NUMBER_WORDS[n]} ({n}) days"
    return f"{n} days"


def _percent(rng: random.Random, p: float) -> str:
    text = f"{p:g}"
    words = _NUMBER_WORDS.get(int(p)) if float(p).is_integer() else None
    return rng.choice(
        [f"{text}%", f"{text} per cent", f"{text} percent"] + ([f"{words} per cent ({text}%)"] if words else [])
    )


def _date_text(d: dt.date) -> str:
    return f"{d.day} {d.strftime('%B %Y')}"


def _add_months(d: dt.date, months: int) -> dt.date:
    month0 = d.month - 1 + months
    year, month = d.year + month0 // 12, month0 % 12 + 1
    return dt.date(year, month, min(d.day, 28))


def _clause(heading: str, *sentences: str) -> dict[str, str]:
    return {"heading": heading, "text": " ".join(s for s in sentences if s)}


@dataclass
class _Ctx:
    """Everything clause writers need about the document being generated."""

    rng: random.Random
    kind: str
    spec: TypeSpec
    counterparty: str
    risks: set[str]
    handles_personal_data: bool
    effective: dt.date
    expiry: dt.date
    amount: int
    currency: str
    jurisdiction: str

    @property
    def role(self) -> str:
        return self.spec.role

    def pick(self, options: list[str]) -> str:
        return self.rng.choice(options)


# --- clause writers: each picks a risky phrasing when the risk was planted ------------------


def _parties(c: _Ctx, title: str) -> dict[str, str]:
    grant = ""
    if c.kind == "licence":
        grant = (
            f"The Licensor grants the Company a non-exclusive, non-transferable licence to use "
            f"{c.spec.subject} for its internal business purposes."
        )
    value = f"The total contract value is {c.currency} {c.amount:,}." if c.amount else ""
    personal = ""
    if c.handles_personal_data:
        personal = c.pick(
            [
                f"In providing {c.spec.subject} the {c.role} will process personal data relating to the "
                "Company's employees, customers and suppliers.",
                f"The {c.role} will have access to personally identifiable information held by the Company.",
                f"Performance of this Agreement requires the {c.role} to receive and store personal information "
                "of the Company's customers.",
            ]
            if c.kind != "nda"
            else [
                "Confidential Information disclosed under this Agreement may include personal data relating to "
                "either party's staff and customers.",
            ]
        )
    return _clause(
        "Parties and Scope",
        f'This {title} is made between {COMPANY} (the "Company") and {c.counterparty} (the "{c.role}").',
        grant,
        value,
        personal,
    )


def _term(c: _Ctx) -> dict[str, str]:
    if c.kind == "loan":
        return _clause(
            "Availability and Repayment",
            f"The Facility is available from {_date_text(c.effective)} and the Final "
            f"Repayment Date is {_date_text(c.expiry)}.",
            "The Company shall repay all outstanding Loans in full on the Final Repayment Date.",
        )
    start = (
        f"This Agreement commences on {_date_text(c.effective)} and, unless terminated earlier, continues "
        f'until {_date_text(c.expiry)} (the "Initial Term").'
    )
    years = c.rng.choice([1, 2, 3])
    if "auto_renewal" in c.risks:
        renewal = c.pick(
            [
                "Thereafter this Agreement shall automatically renew for successive periods of twelve (12) months "
                "unless terminated in accordance with its terms.",
                f"On expiry of the Initial Term this Agreement will be renewed automatically for further terms of "
                f"{years} year(s) without any requirement for either party to give notice.",
                "This Agreement shall thereafter be tacitly renewed from year to year.",
                f"The term shall be extended automatically on an evergreen basis for consecutive periods of "
                f"{12 * years} months.",
                f"This Agreement auto-renews for additional one-year terms at the {c.role}'s then-current rates.",
            ]
        )
    else:
        renewal = c.pick(
            [
                f"This Agreement shall renew automatically for a further period of twelve (12) months only if the "
                f"{c.role} has given the Company not less than {_days(c.rng, 60)}' written notice of the upcoming "
                "renewal and the Company has not opted out.",
                "Any renewal of this Agreement shall be agreed in writing by the parties.",
                "This Agreement shall expire at the end of the Initial Term and shall not renew automatically.",
                "This Agreement will not be extended automatically; any extension requires a signed amendment.",
                "",
            ]
        )
    return _clause(c.pick(["Term", "Duration", "Term and Renewal"]), start, renewal)


def _payment(c: _Ctx) -> dict[str, str] | None:
    if c.kind == "nda":
        return None
    if c.kind == "lease":
        return _clause(
            "Rent",
            f"The annual rent of {c.currency} {c.amount:,} is payable quarterly in advance on the usual quarter days.",
            c.pick(["The rent shall be reviewed on each fifth anniversary of the term.", ""]),
        )
    if c.kind == "loan":
        rate = c.rng.choice([3.5, 4.25, 5, 6.75, 8])
        return _clause(
            "Interest",
            f"Interest accrues on each Loan at {rate:g}% per annum and is payable quarterly in arrears.",
            "Default interest accrues on overdue amounts at 2% per annum above the applicable rate.",
        )
    n = c.rng.choice([105, 120, 150, 180] if "long_payment_terms" in c.risks else [14, 30, 45, 60, 90])
    main = c.pick(
        [
            f"The Company shall pay each valid and undisputed invoice within {_days(c.rng, n)} of receipt.",
            f"Payment terms are net {n} days from the date of invoice.",
            f"Invoices are payable {_days(c.rng, n)} after the end of the month in which they are received.",
            f"All sums due under this Agreement shall be paid no later than {n} calendar days following receipt "
            "of a correct invoice.",
        ]
    )
    vat = c.pick(["All amounts are stated exclusive of VAT, which shall be payable in addition.", ""])
    interest = c.pick(
        [f"Late payments shall bear interest at {c.rng.choice([2, 4, 8])}% per annum above the base rate.", ""]
    )
    return _clause(c.pick(["Fees and Payment", "Payment", "Charges and Invoicing"]), main, vat, interest)


def _exclusivity(c: _Ctx) -> dict[str, str] | None:
    if c.kind not in ("supply", "services"):
        return None
    s = c.spec.subject
    if "exclusivity" in c.risks:
        heading, text = c.rng.choice(
            [
                (
                    "Exclusivity",
                    f"During the Term the Company shall purchase all of its requirements for {s} "
                    f"exclusively from the {c.role}.",
                ),
                (
                    "Exclusive Appointment",
                    f"The Company appoints the {c.role} as its exclusive provider of {s} in all "
                    "territories in which the Company operates.",
                ),
                (
                    "Sourcing Commitment",
                    f"During the Term the Company shall not procure {s} or any similar goods or "
                    "services from any other supplier.",
                ),
                (
                    "Preferred Supplier",
                    f"The Company shall not purchase {s} from any third party while this Agreement remains in force.",
                ),
            ]
        )
        return _clause(heading, text)
    if c.rng.random() < 0.5:
        return _clause(
            "Non-exclusivity",
            f"This Agreement is non-exclusive and nothing in it shall prevent the "
            f"Company from procuring {s} from any other supplier.",
        )
    return None


def _penalty(c: _Ctx) -> dict[str, str] | None:
    presence = {"supply": 0.6, "services": 0.5, "licence": 0.3, "lease": 0.5, "loan": 0.7}.get(c.kind, 0.0)
    planted = "excessive_penalty" in c.risks
    if not planted and c.rng.random() >= presence:
        return None
    p = c.rng.choice([12, 15, 20, 25, 30] if planted else [2, 5, 7.5, 10])
    pct = _percent(c.rng, p)
    if c.kind == "supply":
        weekly = c.rng.choice([0.5, 1, 1.5, 2])
        return c.rng.choice(
            [
                _clause(
                    "Liquidated Damages",
                    f"If the {c.role} fails to deliver the Products by the agreed delivery date, the {c.role} shall "
                    f"pay liquidated damages of {weekly:g}% of the Contract Price for each week of delay, up to a "
                    f"maximum of {pct} of the Contract Price.",
                    "Such liquidated damages shall be the Company's sole and exclusive remedy for delay.",
                ),
                _clause(
                    "Cancellation Charges",
                    f"If the Company cancels an order after acceptance, the Company shall pay a cancellation fee "
                    f"equal to {pct} of the value of the cancelled order.",
                ),
            ]
        )
    if c.kind == "services":
        return c.rng.choice(
            [
                _clause(
                    "Early Termination Charges",
                    f"Should the Company terminate this Agreement before the end of the Initial Term, it shall pay an "
                    f"early termination fee equal to {pct} of the remaining Contract Value.",
                ),
                _clause(
                    "Non-solicitation",
                    "Neither party shall solicit any employee of the other engaged in the Services.",
                    f"A penalty of {pct} of the annual fees shall be payable for each breach of this clause.",
                ),
            ]
        )
    if c.kind == "licence":
        return _clause(
            "Audit Shortfall",
            "If an audit reveals that the Company has used more licences than it has paid for, the Company "
            f"shall pay the shortfall together with a penalty of {pct} of the licence fees for the period "
            "concerned.",
        )
    if c.kind == "lease":
        return _clause(
            "Break Clause",
            "The Company may terminate this Lease on the third anniversary of the term commencement date on "
            f"payment of a break fee equal to {pct} of the annual rent.",
        )
    return _clause(
        "Prepayment",
        f"The Company may prepay the Loan in whole or in part on not less than ten (10) Business Days' "
        f"prior notice, subject to a prepayment fee of {pct} of the amount prepaid.",
    )


def _liability(c: _Ctx) -> dict[str, str] | None:
    if c.kind == "loan":
        return None
    heading = c.pick(["Limitation of Liability", "Liability", "Liability Cap", "Limits on Liability"])
    carve_out = (
        "Nothing in this Agreement limits or excludes either party's liability for death or personal "
        "injury caused by negligence, or for fraud or fraudulent misrepresentation."
    )
    indirect = (
        "Neither party shall be liable for any indirect or consequential loss, including without "
        "limitation loss of profits, revenue or goodwill."
    )
    if "unlimited_liability" in c.risks:
        cap = c.pick(
            [
                "The Company's liability under or in connection with this Agreement shall be unlimited.",
                f"The Company shall be liable without limitation for all direct and indirect losses suffered by the "
                f"{c.role}.",
                "There shall be no cap on the Company's aggregate liability under this Agreement.",
                "The Company's total liability shall not be subject to any financial cap or limit.",
            ]
        )
    else:
        cap = c.pick(
            [
                "Each party's total aggregate liability under this Agreement shall not exceed an amount equal to the "
                "fees paid in the twelve (12) months preceding the claim.",
                "Each party's total liability shall be capped at one hundred per cent (100%) of the Contract Value.",
                f"Each party's aggregate liability shall not exceed {c.currency} {max(c.amount, 250_000):,}.",
            ]
        )
    parts = [carve_out, cap, indirect]
    c.rng.shuffle(parts)
    return _clause(heading, *parts)


def _indemnity(c: _Ctx) -> dict[str, str] | None:
    planted = "uncapped_indemnity" in c.risks
    if not planted and c.kind == "nda" and c.rng.random() < 0.6:
        return None
    heading = c.pick(["Indemnity", "Indemnification", "Indemnities"])
    r = c.role
    if planted:
        text = c.pick(
            [
                f"The Company shall indemnify, defend and hold harmless the {r} from and against all losses, claims "
                "and expenses arising out of this Agreement, without limitation as to amount.",
                f"The Company undertakes to keep the {r} fully indemnified against any and all liabilities, and such "
                "indemnity shall not be subject to any cap or limitation of liability.",
                f"The Company agrees to indemnify the {r} in full for all losses, and the limitations in the "
                "Limitation of Liability clause shall not apply to this indemnity.",
                f"The Company will indemnify the {r} against all third-party claims on an uncapped basis.",
            ]
        )
    else:
        text = c.pick(
            [
                f"The {r} shall indemnify the Company against all losses arising from any infringement of third-party "
                "intellectual property rights, without limitation as to amount.",
                f"The Company shall indemnify the {r} against third-party claims arising from the Company's breach, "
                "subject always to the limitations set out in the Limitation of Liability clause.",
                "Each party shall indemnify the other against losses, including without limitation reasonable legal "
                "fees, arising from its negligence, up to the aggregate cap in the Limitation of Liability clause.",
            ]
        )
    return _clause(heading, text)


def _termination(c: _Ctx) -> dict[str, str]:
    r = c.role
    breach = (
        "Either party may terminate this Agreement with immediate effect by written notice if the other party "
        "commits a material breach which is not remedied within thirty (30) days of notice requiring it to "
        "do so."
    )
    if "unilateral_termination" in c.risks:
        extra = c.pick(
            [
                f"The {r} may terminate this Agreement at any time for convenience by giving {_days(c.rng, 30)}' notice.",
                f"The {r} reserves the right to terminate this Agreement at its sole discretion, without cause and "
                "without liability to the Company.",
                f"The {r} shall be entitled to terminate this Agreement forthwith for any reason or no reason.",
                f"Notwithstanding anything to the contrary, the {r} may at any time, in its absolute discretion, "
                "terminate this Agreement.",
            ]
        )
    else:
        extra = c.pick(
            [
                f"The Company may terminate this Agreement for convenience on giving not less than {_days(c.rng, 90)}' "
                "written notice.",
                "Either party may terminate this Agreement for convenience on not less than three (3) months' written "
                "notice.",
                f"The {r} may terminate this Agreement immediately if the Company fails to pay any undisputed sum within "
                "thirty (30) days of a written demand.",
                "",
            ]
        )
    return _clause("Termination", breach, extra)


def _data_protection(c: _Ctx) -> dict[str, str] | None:
    if c.kind in ("lease", "loan"):
        return None
    if c.handles_personal_data:
        if "missing_data_protection" in c.risks:
            return None
    elif c.rng.random() >= 0.2:
        return None
    heading, text = c.rng.choice(
        [
            (
                "Data Protection",
                "Each party shall comply with all applicable Data Protection Laws, including the General Data Protection "
                f"Regulation (EU) 2016/679. Where the {c.role} processes personal data on behalf of the Company, it shall "
                "do so only on documented instructions and in accordance with the data processing agreement set out in "
                "Schedule 3.",
            ),
            (
                "Privacy and Data Protection",
                f"The {c.role} shall process personal information only as necessary to perform this Agreement and in "
                "compliance with applicable data protection legislation, and shall enter into a Data Processing Addendum "
                "on request.",
            ),
            (
                "Data Processing",
                "The parties shall enter into a data processing agreement complying with Article 28 of the GDPR before any "
                "personal data is shared.",
            ),
        ]
    )
    return _clause(heading, text)


def _governing_law(c: _Ctx) -> dict[str, str]:
    j = c.jurisdiction
    text = c.pick(
        [
            "This Agreement and any dispute or claim arising out of or in connection with it shall be governed by and "
            f"construed in accordance with the laws of {j}.",
            f"This Agreement is governed by the laws of {j}, and the courts of {j} shall have exclusive jurisdiction to "
            "settle any dispute arising out of it.",
            f"The laws of {j} govern this Agreement and all non-contractual obligations arising from it.",
        ]
    )
    submit = c.pick([f"The parties irrevocably submit to the exclusive jurisdiction of the courts of {j}.", ""])
    return _clause(c.pick(["Governing Law", "Governing Law and Jurisdiction", "Applicable Law"]), text, submit)


_COMMERCIAL = frozenset({"supply", "services", "licence"})
_ANY = frozenset(CONTRACT_TYPES)

# (contract types it suits, writer) — e.g. an IP-in-Deliverables clause makes no sense in a lease.
_BOILERPLATE: tuple[tuple[frozenset[str], Callable[[_Ctx], dict[str, str]]], ...] = (
    (
        _ANY - {"nda"},
        lambda c: _clause(
            "Confidentiality",
            "Each party shall keep confidential all information received from the other under this Agreement and "
            "shall use it solely for the purposes of this Agreement.",
            "This obligation survives termination for five (5) years.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Force Majeure",
            "Neither party shall be liable for any delay or failure to perform caused by events beyond its reasonable "
            "control.",
            f"If a force majeure event continues for more than {_days(c.rng, 90)}, either party may terminate this "
            "Agreement on written notice.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Assignment",
            "Neither party may assign or transfer any of its rights under this Agreement without the prior written "
            "consent of the other, such consent not to be unreasonably withheld.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Notices",
            "Notices shall be in writing and delivered by hand, by pre-paid post or by email to the addresses set out "
            "above.",
            "Notices sent by post are deemed received two (2) business days after posting.",
        ),
    ),
    (
        _COMMERCIAL,
        lambda c: _clause(
            "Intellectual Property",
            "All intellectual property rights in the Deliverables shall vest in and remain the exclusive property of "
            "the Company.",
        ),
    ),
    (
        _COMMERCIAL | {"lease"},
        lambda c: _clause(
            "Insurance",
            f"The {c.role} shall maintain public liability insurance of not less than {c.currency} 5,000,000 for the "
            "duration of this Agreement.",
        ),
    ),
    (
        _COMMERCIAL,
        lambda c: _clause(
            "Audit",
            f"The Company may, on reasonable notice, audit the {c.role}'s records relating to this Agreement once in "
            "any twelve (12) month period.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Anti-Bribery",
            "Each party shall comply with all applicable anti-bribery and anti-corruption laws, including the Bribery "
            "Act 2010.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Entire Agreement",
            "This Agreement constitutes the entire agreement between the parties and supersedes all prior agreements "
            "relating to its subject matter.",
            "Nothing in this clause limits or excludes liability for fraud.",
        ),
    ),
    (
        _ANY,
        lambda c: _clause(
            "Severability",
            "If any provision of this Agreement is held invalid, the remaining provisions shall continue in full force "
            "and effect.",
        ),
    ),
)


# --- document assembly ---------------------------------------------------------------------


def _plant_risks(rng: random.Random, spec: TypeSpec) -> tuple[set[str], bool]:
    # A fixed iteration order keeps the random stream (and so the corpus) stable.
    risks = {name for name, rate in RISK_RATES.items() if name in spec.risks and rng.random() < rate}
    handles_pd = rng.random() < spec.personal_data_rate
    if handles_pd and "missing_data_protection" in spec.risks and rng.random() < MISSING_DP_RATE:
        risks.add("missing_data_protection")
    return risks, handles_pd


def _company_name(rng: random.Random) -> str:
    return f"{rng.choice(_NAME_HEADS)} {rng.choice(_NAME_TAILS)} {rng.choice(_NAME_SUFFIXES)}"


def generate_document(rng: random.Random, index: int, as_of: dt.date) -> tuple[dict[str, Any], dict[str, Any]]:
    """One document and its ground-truth record, both derived only from generator decisions."""
    kinds = list(CONTRACT_TYPES)
    kind = rng.choices(kinds, weights=[CONTRACT_TYPES[k].weight for k in kinds])[0]
    spec = CONTRACT_TYPES[kind]
    risks, handles_pd = _plant_risks(rng, spec)

    if "unusual_jurisdiction" in risks:
        jurisdiction = rng.choice(UNUSUAL_JURISDICTIONS)
        currency = rng.choice(["USD", "USD", "EUR"])
    else:
        jurisdiction = rng.choice(list(USUAL_JURISDICTIONS))
        currency = USUAL_JURISDICTIONS[jurisdiction]
    # Mostly recent contracts, with a tail of older ones that have run out by as_of.
    effective = as_of - dt.timedelta(days=rng.randint(30, 4 * 365))
    expiry = _add_months(effective, rng.choice(spec.term_months)) - dt.timedelta(days=1)
    low, high = spec.amount_range
    amount = round(rng.randint(low, high), -2) if high else 0

    c = _Ctx(rng, kind, spec, _company_name(rng), risks, handles_pd, effective, expiry, amount, currency, jurisdiction)
    title = rng.choice(spec.titles)
    writers: list[Callable[[], dict[str, str] | None]] = [
        lambda: _parties(c, title),
        lambda: _term(c),
        lambda: _payment(c),
        lambda: _exclusivity(c),
        lambda: _penalty(c),
        lambda: _liability(c),
        lambda: _indemnity(c),
        lambda: _data_protection(c),
        lambda: _termination(c),
    ]
    clauses = [cl for cl in (w() for w in writers) if cl is not None]
    suitable = [write for kinds_, write in _BOILERPLATE if kind in kinds_]
    extras = rng.sample(range(len(suitable)), k=min(len(suitable), rng.randint(3, 6)))
    clauses += [suitable[i](c) for i in sorted(extras)]
    clauses.append(_governing_law(c))

    doc_id = f"doc-{index:05d}"
    doc = {
        "id": doc_id,
        "title": f"{title} - {c.counterparty}",
        "counterparty": c.counterparty,
        "counterparty_role": spec.role,
        "contract_type": kind,
        "effective_date": effective.isoformat(),
        "expiry_date": expiry.isoformat(),
        "amount": amount,
        "currency": currency,
        "jurisdiction": jurisdiction.removeprefix("the "),
        "clauses": clauses,
    }
    truth = {
        "risks": [r for r in RISK_CATEGORIES if r in risks],
        "expired": expiry < as_of,
        "contract_type": kind,
        "handles_personal_data": handles_pd,
        "amount": amount,
        "currency": currency,
    }
    return doc, truth


def generate_documents(
    count: int, seed: int, as_of: str = DEFAULT_AS_OF
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pure: (document, truth) pairs for doc-00001 .. doc-<count>."""
    rng = random.Random(seed)  # noqa: S311 (reproducible test data from a seed, not a secret)
    as_of_date = dt.date.fromisoformat(as_of)
    return [generate_document(rng, i, as_of_date) for i in range(1, count + 1)]


def doc_key(prefix: str, index: int) -> str:
    return f"{prefix}/docs/doc-{index:05d}.json"


def generate_corpus(
    store: BlobStore, prefix: str, count: int, seed: int = 42, as_of: str = DEFAULT_AS_OF
) -> dict[str, Any]:
    """Write the documents, manifest.json and truth.json under ``prefix``; returns the manifest."""
    prefix = prefix.strip("/")
    keys: list[str] = []
    truth_docs: dict[str, Any] = {}
    for i, (doc, truth) in enumerate(generate_documents(count, seed, as_of), start=1):
        key = doc_key(prefix, i)
        store.put(key, json.dumps(doc, indent=2).encode(), "application/json")
        keys.append(key)
        truth_docs[doc["id"]] = truth
    by_category = {cat: sum(cat in t["risks"] for t in truth_docs.values()) for cat in RISK_CATEGORIES}
    truth = {
        "count": count,
        "seed": seed,
        "asOf": as_of,
        "categories": list(RISK_CATEGORIES),
        "totals": {"byCategory": by_category, "expired": sum(t["expired"] for t in truth_docs.values())},
        "documents": truth_docs,
    }
    manifest = {"count": count, "seed": seed, "asOf": as_of, "documents": keys}
    store.put(f"{prefix}/truth.json", json.dumps(truth, indent=2).encode(), "application/json")
    # The manifest goes last: its presence means the corpus is complete.
    store.put(f"{prefix}/manifest.json", json.dumps(manifest, indent=2).encode(), "application/json")
    return manifest

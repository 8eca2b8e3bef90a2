"""The document_review report as Markdown (the JSON report is the agent's result)."""

from __future__ import annotations

from typing import Any


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
        _table(
            ["Level", "Documents", "Share"], [[lvl, n, f"{100 * n / reviewed:.1f}%"] for lvl, n in s["byLevel"].items()]
        ),
        "## Risk categories",
        _table(
            ["Category", "Documents", "Share"],
            [
                [cat, n, f"{100 * n / reviewed:.1f}%"]
                for cat, n in sorted(s["byCategory"].items(), key=lambda kv: (-kv[1], kv[0]))
            ],
        ),
        "## Contract types",
        _table(["Contract type", "Documents"], [[k, n] for k, n in s["byContractType"].items()]),
        "## Value at high risk",
        _table(["Currency", "Total amount"], [[cur, f"{amt:,.0f}"] for cur, amt in s["highRiskAmount"].items()])
        if s["highRiskAmount"]
        else "_No high-risk documents carry a value._",
        f"## Top {len(s['topRisks'])} risks",
        _table(
            ["#", "Document", "Type", "Score", "Level", "Rules"],
            [
                [i, f"{t['id']} — {t['title']}", t["contractType"], t["score"], t["level"], ", ".join(t["rules"])]
                for i, t in enumerate(s["topRisks"], start=1)
            ],
        ),
        "## Rules",
        f"Levels: low < {report['thresholds']['medium']} ≤ medium < {report['thresholds']['high']} ≤ high. "
        "A category scores once, at the weight of its strongest matching rule.",
        _table(
            ["Rule", "Category", "Weight", "What it flags"],
            [[r["name"], r["category"], r["weight"], r["description"]] for r in report["rules"]],
        ),
    ]
    return "\n\n".join(parts) + "\n"

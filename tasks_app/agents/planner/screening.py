"""Prompt-injection screening (seed §14), heuristics only: text from tools and documents
that reads like instructions to a model. A suspicion is not a verdict: the fact is kept,
fenced and marked in the context, and the next side-effecting call waits for an approver."""

from __future__ import annotations

import re

PATTERNS = {
    "ignore-instructions": r"\b(ignore|disregard|forget)\b.{0,40}\b(previous|prior|above|earlier|all|your)\b.{0,30}"
    r"\b(instructions?|prompts?|rules|directions)\b",
    "new-instructions": r"\b(new|updated|real)\s+(instructions?|system prompt|task)\s*:",
    "role-override": r"\b(you are now|act as|from now on,? you)\b",
    "prompt-markup": r"(<\|im_start\|>|<\|system\|>|\[/?INST\]|^\s*(system|assistant)\s*:)",
    "exfiltration": r"\b(reveal|print|send|leak|exfiltrate|email)\b.{0,40}\b(system prompt|api[ _-]?keys?|secrets?|"
    r"passwords?|credentials?|tokens?)\b",
}
_COMPILED = {name: re.compile(rx, re.IGNORECASE | re.MULTILINE | re.DOTALL) for name, rx in PATTERNS.items()}


def screen(text: str) -> list[str]:
    """The names of the patterns `text` matches (empty: nothing suspicious)."""
    sample = text[:200_000]
    return [name for name, rx in _COMPILED.items() if rx.search(sample)]

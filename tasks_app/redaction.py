"""Masking of secrets and configured personal fields before anything is stored for people
to read (events, audit data). A first version: the ledger's diagnostics will use it too."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings

MASK = "***"
_SECRET_KEY = re.compile(r"pass(word|wd)?$|secret|token|api[_-]?key|authori[sz]ation|cookie|credential|"
                         r"private[_-]?key|session", re.IGNORECASE)
# A secret named by its key inside a string (an error message, a URL, a printed dict): the
# value is masked and the key kept, so the line still says what was there.
_KEY_IN_TEXT = (r"[A-Za-z0-9_-]*(?i:pass(?:word|wd)|secret|token|api[_-]?key|authori[sz]ation|cookie|credential|"
                r"private[_-]?key|session)")
_SECRET_VALUE = re.compile(
    r"(?P<bearer>\b(?:Bearer|Basic|Token)\s+)[A-Za-z0-9._~+/=-]{8,}"  # authorization header values
    r"|\brt_[0-9a-f]{12}_[A-Za-z0-9_-]{20,}"  # our own API keys
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\b(?:sk|pk|ghp|gho|xox[abp])[-_][A-Za-z0-9-_]{16,}"  # common vendor tokens
    rf"|(?P<quoted>{_KEY_IN_TEXT}[\"']\s*[:=]\s*[\"'])[^\"']*"  # 'password': 'x', "api_key": "x"
    rf"|(?P<named>\b{_KEY_IN_TEXT}\s*[:=]\s*(?:(?:Bearer|Basic|Token)\s+)?)[^\s\"'&;,}})]+"  # api_key=x, X-Api-Key: x
    r"|(?P<userinfo>://[^/\s:@]+:)[^/\s@]+(?=@)"  # https://user:password@host
)


def _mask(text: str) -> str:
    return _SECRET_VALUE.sub(
        lambda m: (m.group("bearer") or m.group("quoted") or m.group("named") or m.group("userinfo") or "") + MASK,
        text)


def _personal_fields() -> frozenset[str]:
    return frozenset(f.lower() for f in settings.RUNTIME.get("security", {}).get("redact_fields", []))


def redact(value: Any, _personal: frozenset[str] | None = None) -> Any:
    """A copy of value with secret-looking keys, configured personal fields and token-like
    strings masked."""
    personal = _personal_fields() if _personal is None else _personal
    if isinstance(value, dict):
        return {k: MASK if isinstance(k, str) and (_SECRET_KEY.search(k) or k.lower() in personal)
                else redact(v, personal) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, personal) for v in value]
    if isinstance(value, str):
        return _mask(value)
    return value


class RedactingFilter:
    """logging filter: token-like values never reach the logs either (settings.LOGGING)."""

    def filter(self, record: Any) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a broken format string is the logging module's problem, not ours)
            return True
        redacted = _mask(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True

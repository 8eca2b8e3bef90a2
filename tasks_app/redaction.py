"""Masking of secrets and personal data before anything is stored or shown for people to
read: events, audit records, task errors and reasons, ledger diagnostics and logs. One place:
by key (secret-looking names, security.redact_fields) and by value (tokens, keys, bearer
headers, passwords in text, emails, card numbers), so what flows in from a tool's answer is
masked too, whatever it is called. `tool_text` also bounds a remote's error body."""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

from django.conf import settings

MASK = "***"
_SECRET_KEY = re.compile(
    r"pass(word|wd|phrase)?$|pwd$|secret|token|api[_-]?key|authori[sz]ation|cookie|credential|"
    r"private[_-]?key|session",
    re.IGNORECASE,
)
# A secret named by its key inside a string (an error message, a URL, a printed dict, a
# config file quoted back): the value is masked and the key kept, so the line still says what
# was there. The secret word may sit anywhere in the name (aws_secret_access_key,
# clientSecretValue), as for a dict's keys, but not inside a longer word (max_tokens,
# sessions: counts, not secrets).
# It starts where a run of name characters starts (the lookbehind), never inside one, and the
# run is taken whole (possessive): from each position inside, the scan to the run's end and
# back made masking quadratic, and one 16 KB query string in an access log line held the web
# process's event loop for 25 s. The lookahead scans the run once, to find the secret word.
_NAME_WORDS = (
    r"(?i:pass(?:word|wd|phrase)|pwd|secret|token|api[_-]?key|authori[sz]ation|cookie|credential|private[_-]?key|"
    r"session)"
)
_KEY_IN_TEXT = rf"(?<![A-Za-z0-9_-])(?=[A-Za-z0-9_-]*?{_NAME_WORDS}(?![a-z0-9]))[A-Za-z0-9_-]++"
# The same written percent-encoded (a query string quoted inside another URL, a form body, a
# redirect_uri): `access_token%3Dabc`, `%22token%22%3A%22abc%22`, `Authorization%3A%20Bearer%20abc`,
# once or more (%253D). The key's run takes the hex of an escape before it (`%26access_token`
# is the run `26access_token`), which is kept with the key. The value runs to a raw stop or an
# encoded one (space, quotes, &, ), comma, ;, }), and keeps escapes that are part of it
# (+, /, = of base64: %2B, %2F, %3D).
_ESC = r"%(?:25)*+"
_ENC_QUOTE = rf"{_ESC}2[27]"
# Around the = or : any whitespace, raw or encoded (%20, a tab's %09, a form's +).
_ENC_SPACE = rf"(?:\s|\+|{_ESC}(?:20|09))"
_ENC_SEPARATOR = rf"{_ENC_SPACE}*+{_ESC}3[ADad]{_ENC_SPACE}*+"
_ENC_SCHEME = rf"(?:(?:Bearer|Basic|Token)(?:\+|{_ESC}20)++)?"
_ENC_VALUE = r"(?:[^\s\"'&;,})%]|%(?!(?:25)*+(?:2[026-7Cc9]|3[Bb]|7[Dd]))[0-9A-Fa-f]{2})++"
_ENC_QUOTED_VALUE = r"(?:[^\s\"'%]|%(?!(?:25)*+2[27])[0-9A-Fa-f]{2})++"  # after an encoded quote: to the next one
_SECRET_VALUE = re.compile(
    r"(?P<bearer>\b(?:Bearer|Basic|Token)\s+)[A-Za-z0-9._~+/=-]{8,}"  # authorization header values
    r"|\brt_[0-9a-f]{12}_[A-Za-z0-9_-]{20,}"  # our own API keys
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\b(?:sk|pk|ghp|gho|xox[abp])[-_][A-Za-z0-9-_]{16,}"  # common vendor tokens
    r"|\bgithub_pat_[A-Za-z0-9_]{20,}|\bAIza[0-9A-Za-z_-]{30,}"  # GitHub fine-grained, Google API keys
    # A PEM private key, to its END line (or as far as it goes, when cut or escaped in JSON).
    r"|-----BEGIN[A-Z ]*PRIVATE KEY-----[A-Za-z0-9+/=\s\\]*(?:-----END[A-Z ]*PRIVATE KEY-----)?"
    rf"|(?P<quoted>{_KEY_IN_TEXT}\\*[\"']\s*[:=]\s*\\*[\"'])[^\"'\\]*"  # 'password': 'x', "api_key": "x", \"token\":\"x\"
    rf"|(?P<bare>{_KEY_IN_TEXT}\\*[\"']\s*[:=]\s*)[^\s\"'\\,{{}}\[\]]+"  # "pin_secret": 1234 (a number, true)
    # api_key="x", token: 'x': to the closing quote
    rf"|(?P<unquoted>{_KEY_IN_TEXT}\s*[:=]\s*\\*[\"'](?:(?:Bearer|Basic|Token)\s+)?)[^\"'\\]*"
    rf"|(?P<named>{_KEY_IN_TEXT}\s*[:=]\s*(?:(?:Bearer|Basic|Token)\s+)?)[^\s\"'&;,}})]+"  # api_key=x, X-Api-Key: x
    r"|(?P<userinfo>://[^/\s:@]+:)[^/\s@]+(?=@)"  # https://user:password@host
    # percent-encoded: access_token%3Dabc, %22password%22%3A%22x%22 (above)
    rf"|(?P<encquoted>{_KEY_IN_TEXT}(?:{_ENC_QUOTE})?{_ENC_SEPARATOR}{_ENC_QUOTE}{_ENC_SCHEME}){_ENC_QUOTED_VALUE}"
    rf"|(?P<encoded>{_KEY_IN_TEXT}(?:{_ENC_QUOTE})?{_ENC_SEPARATOR}{_ENC_SCHEME}){_ENC_VALUE}"
    # https%3A%2F%2Fuser%3Apassword%40host
    rf"|(?P<encuserinfo>{_ESC}3[Aa]{_ESC}2[Ff]{_ESC}2[Ff](?:[^/\s:@%]|%(?!(?:25)*+(?:3[Aa]|40|2[Ff]))[0-9A-Fa-f]{{2}})++{_ESC}3[Aa])"
    rf"(?:[^/\s@%]|%(?!(?:25)*+(?:40|2[Ff]))[0-9A-Fa-f]{{2}})++(?={_ESC}40)"
)


# Values that are personal data whatever key they sit under: a tool's answer quoted into an
# error message has no field names to go by.
_EMAIL = re.compile(rf"(?<![\w.%+-])[A-Za-z0-9._%+-]+(?:@|{_ESC}40)[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{{2,}}\b")
# Issuers' first digits: 3 (Amex, Diners, JCB) to 6 (Discover), and Mastercard's 2-series (2221-2720).
_CARD_START = r"(?:2[2-7]|[3-6]\d)\d{2}"
_CARD = re.compile(rf"(?<![\w-]){_CARD_START}(?:[ -]?\d){{9,15}}(?![\w-])")
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


def _luhn(digits: str) -> bool:
    total = 0
    for i, d in enumerate(int(c) for c in reversed(digits)):
        total += d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2)
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group(0))
    # Only what passes the card checksum: order numbers and timestamps mostly do not.
    return MASK if 13 <= len(digits) <= 19 and _luhn(digits) else match.group(0)


def _card_number(value: int) -> bool:
    """A card number sent as a JSON number: 13 to 19 digits, as _CARD and _card take them in text."""
    digits = str(value)
    return _CARD.fullmatch(digits) is not None and _luhn(digits)


@lru_cache(maxsize=8)
def _personal_in_text(personal: frozenset[str]) -> re.Pattern[str] | None:
    """A configured personal field quoted in text ('"phone": "+1 555"', phone=+1555): the
    value is masked, the name kept."""
    if not personal:
        return None
    names = "|".join(re.escape(name) for name in sorted(personal))
    # percent-encoded (phone%3D%2B1555, %22email%22%3A%22...): as for secrets; after an escape
    # (%26email) is a start too, which \b is not
    encoded_name = rf"(?:\b|(?<=%[0-9A-Fa-f]{{2}}))(?i:{names})(?:{_ENC_QUOTE})?"
    # \\* : the same quoted inside JSON that is itself quoted (an error body echoing a payload).
    return re.compile(
        rf"(?P<quoted>(?i:\b(?:{names}))\\*[\"']\s*[:=]\s*\\*[\"'])[^\"'\\]*"
        rf"|(?P<named>(?i:\b(?:{names}))\s*[:=]\s*)[^\s\"'&;,}})]+"
        rf"|(?P<encquoted>{encoded_name}{_ENC_SEPARATOR}{_ENC_QUOTE}){_ENC_QUOTED_VALUE}"
        rf"|(?P<encoded>{encoded_name}{_ENC_SEPARATOR}){_ENC_VALUE}"
    )


_KEPT = ("bearer", "quoted", "bare", "unquoted", "named", "userinfo", "encquoted", "encoded", "encuserinfo")


def _kept(match: re.Match[str]) -> str:
    """What of a secret's match stays: its name and separator, or its scheme."""
    return next((kept for group in _KEPT if (kept := match.group(group))), "")


def _kept_personal(match: re.Match[str]) -> str:
    return next((kept for group in ("quoted", "named", "encquoted", "encoded") if (kept := match.group(group))), "")


# What every pattern above needs somewhere in a text to match at all: one search tells the
# texts that need none of them (ids, timestamps, a status, most of what the runtime writes
# itself), which were a third of a task's first slice's CPU time (the snapshot event's
# fourteen strings, five substitutions each). Each branch is a literal its patterns cannot
# match without: a secret's name or scheme, a vendor's prefix, @ or % (emails, userinfo,
# anything percent-encoded), a JWT's header, a card number's shortest form (13 digits: its
# first four alone sent every timestamp whose fraction starts with 3 to 6, such as the
# snapshot's createdAt, through the substitutions, 0.6 ms each).
_MAYBE_SECRET = re.compile(
    r"@|%|eyJ|-----BEGIN|\b(?:Bearer|Basic|Token)\s|\b(?:rt_|AKIA|ASIA|github_pat_|AIza)"
    rf"|\b(?:sk|pk|ghp|gho|xox[abp])[-_]|(?<![\w-]){_CARD_START}(?:[ -]?\d){{9}}|{_NAME_WORDS}"
)


@lru_cache(maxsize=8)
def _maybe_personal(personal: frozenset[str]) -> re.Pattern[str] | None:
    """... and a configured personal field's name, which _personal_in_text needs."""
    if not personal:
        return None
    return re.compile("(?i:" + "|".join(re.escape(name) for name in sorted(personal)) + ")")


def _mask(text: str, personal: frozenset[str] = frozenset()) -> str:
    if not _MAYBE_SECRET.search(text) and not ((names := _maybe_personal(personal)) and names.search(text)):
        return text  # nothing _mask_all looks for can be in it
    return _mask_all(text, personal)


def _mask_all(text: str, personal: frozenset[str]) -> str:
    # A pattern added here needs what it cannot match without in _MAYBE_SECRET, and a text it
    # masks in the tests' MASKED_SEEDS (test_redaction), or _mask will pass texts it would mask.
    text = _SECRET_VALUE.sub(lambda m: _kept(m) + MASK, text)
    if (pattern := _personal_in_text(personal)) is not None:
        text = pattern.sub(lambda m: _kept_personal(m) + MASK, text)
    text = _JWT.sub(MASK, text)
    text = _EMAIL.sub(MASK, text)
    return _CARD.sub(_card, text)


def _personal_fields() -> frozenset[str]:
    return frozenset(f.lower() for f in settings.RUNTIME.get("security", {}).get("redact_fields", []))


def redact(value: Any, _personal: frozenset[str] | None = None) -> Any:
    """A copy of value with secret-looking keys, configured personal fields and secret- or
    personal-looking values (tokens, keys, passwords, emails, card numbers) masked."""
    personal = _personal_fields() if _personal is None else _personal
    if isinstance(value, dict):
        return {
            k: MASK if isinstance(k, str) and (_SECRET_KEY.search(k) or k.lower() in personal) else redact(v, personal)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, personal) for v in value]
    if isinstance(value, str):
        return _mask(value, personal)
    # A card number is personal data as a number too (a tool's answer, a step's log field):
    # only its text was looked at, and {"card": 4111111111111111} was stored as it came.
    # Below 13 digits (counts, sequences, ids, epoch milliseconds start with 1) nothing is.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**12 and _card_number(value):
        return MASK
    return value


# A remote's error body is evidence, not payload: enough to say what went wrong, never the
# whole echo of what was sent.
TOOL_TEXT_LIMIT = 300


def tool_text(text: str, limit: int = TOOL_TEXT_LIMIT) -> str:
    """What a tool answered, fit for a reason, an error or an event: masked first (so a
    secret cut in half by the limit is still found), then cut to `limit` characters."""
    masked = _mask(text, _personal_fields())
    if len(masked) <= limit:
        return masked
    return f"{masked[:limit]}… ({len(masked) - limit} more characters)"


class RedactingFilter:
    """logging filter: token-like values never reach the logs either (settings.LOGGING)."""

    def filter(self, record: Any) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a broken format string is the logging module's problem, not ours)
            return True
        redacted = _mask(message, _personal_fields())
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            # A traceback quotes the exception's message (a tool's error body, say): the
            # formatter reuses exc_text, so masking it here masks every handler's output.
            record.exc_text = _mask(_FORMATTER.formatException(record.exc_info), _personal_fields())
        return True


_FORMATTER = logging.Formatter()

"""The one check hostile input goes through on every edge, and again in the actions that write.

PostgreSQL stores neither NUL in text nor \\u0000 in jsonb; a lone surrogate cannot be
encoded as UTF-8; NaN and Infinity are not JSON (jsonb refuses them); an integer beyond 64
bits overflows a bigint column or an OFFSET; and JSON nested a few thousand levels deep
makes the parser, and every recursive walk after it (schema validation, canonical JSON),
raise RecursionError. Each of these used to surface as a 500 from deep inside a request.
A key given twice in one object is refused too: the parser kept the last, and what the
client meant by the first was dropped without a word. Here each becomes an UnsafeInput
naming where it is, before anything is written.

- loads(): parse and check a body (DRF's parser: runtime_site/parsers.py).
- parse() then check(): the same in two steps, for an edge that reads part of a document it
  refuses (the MCP endpoint echoes the JSON-RPC id); peek_member() when even parse() fails.
- check(): any value already parsed (query strings, headers, the actions' own arguments).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any

MAX_DEPTH = 100  # arrays and objects inside one another: far beyond any real input
MAX_INT = 2**63 - 1  # PostgreSQL bigint
MIN_INT = -(2**63)
# A fraction or an exponent (1e308, 2.5e19) is held to the integers' range as well: "beyond
# 64-bit integers" said nothing to a client that sent no integer.
FLOAT_OUT_OF_RANGE = (
    f"a number outside {MIN_INT}..{MAX_INT}, which every number must keep to (with a fraction or an exponent too)"
)

# NUL, and UTF-16 surrogates: in a str they only ever stand alone (a JSON "\ud83d\ude00"
# pair decodes to one character).
_UNSAFE_CHAR = re.compile("[\x00\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]{1,64}\Z")


class UnsafeInput(ValueError):
    """`where` (a path such as input.docs[2].name; empty for the whole document) holds
    something that is never stored."""

    def __init__(self, where: str, problem: str) -> None:
        if len(where) > 120:  # a path a hundred levels deep says no more than its start
            where = where[:117] + "..."
        super().__init__(f"{where}: {problem}" if where else problem)
        self.where, self.problem = where, problem


class NotJson(UnsafeInput):
    """The bytes are not JSON at all (syntax or encoding): nothing in them can be read."""


class _Refused:
    """Stands in, after parse(), for a value that cannot be kept (NaN, 1e400, an integer
    beyond 64 bits): the parse completes, and check() reports the value with its path."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _int(digits: str) -> int | _Refused:
    # The length first: int() of a huge digit string is slow, and beyond 4,300 digits
    # Python refuses it with a ValueError that would read as a syntax error.
    if len(digits.lstrip("-")) <= 19 and MIN_INT <= (value := int(digits)) <= MAX_INT:
        return value
    return _Refused("an integer beyond 64 bits")


def _float(text: str) -> float | _Refused:
    value = float(text)
    if not math.isfinite(value):
        return _Refused("a number too large to store")
    # One bound for every number, as the OpenAPI document declares it: a client's generator
    # or validator cannot tell 1e19 from the integer 10000000000000000000.
    return value if MIN_INT <= value <= MAX_INT else _Refused(FLOAT_OUT_OF_RANGE)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # RFC 8259 §4 leaves a repeated name's meaning open; {"agent": "a", "agent": "b"} is two
    # answers to one question, so neither is taken. The count is the one the client sent.
    found = dict(pairs)
    if len(found) < len(pairs):
        for key, count in Counter(key for key, _ in pairs).items():
            if count > 1:
                found[key] = _Refused(f"given {count} times in one object; give it once")
    return found


_DECODER = json.JSONDecoder(
    object_pairs_hook=_object,
    parse_constant=lambda name: _Refused(f"{name} is not a JSON number"),
    parse_int=_int,
    parse_float=_float,
)


def parse(data: bytes | str, *, encoding: str = "utf-8") -> Any:
    """The document, unchecked: check() it before use. NotJson when it is not JSON;
    UnsafeInput when it is nested too deeply to parse at all."""
    if isinstance(data, bytes):
        try:
            data = data.decode(encoding)
        # UnicodeError, not only UnicodeDecodeError: punycode and idna raise the bare one.
        except (UnicodeError, LookupError):
            raise NotJson("", f"the body is not valid {encoding}") from None
    try:
        return _DECODER.decode(data)
    except RecursionError:  # the C parser's own guard, a thousand-odd levels down
        raise UnsafeInput("", f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise NotJson("", f"not valid JSON ({exc})") from None


def loads(data: bytes | str, *, encoding: str = "utf-8") -> Any:
    value = parse(data, encoding=encoding)
    check(value)
    return value


def check(value: Any, where: str = "") -> None:
    """UnsafeInput for the first thing in `value`, in document order, that is never
    stored. Walks without recursion, so no depth makes it raise RecursionError."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if problem := _text_problem(value):
                raise UnsafeInput(path, problem)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not MIN_INT <= value <= MAX_INT:
                raise UnsafeInput(path, "an integer beyond 64 bits")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise UnsafeInput(path, f"{value} is not a JSON number")
            if not MIN_INT <= value <= MAX_INT:
                raise UnsafeInput(path, FLOAT_OUT_OF_RANGE)
        elif isinstance(value, _Refused):
            raise UnsafeInput(path, value.problem)
        elif isinstance(value, dict | list | tuple):
            if depth >= MAX_DEPTH:
                raise UnsafeInput(path, f"nested more than {MAX_DEPTH} levels deep")
            if isinstance(value, dict):
                children = []
                for key, item in value.items():
                    child = _join(path, key)
                    if isinstance(key, str) and (problem := _text_problem(key)):
                        raise UnsafeInput(child, f"the key {problem}")
                    children.append((item, child, depth + 1))
            else:
                children = [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
            stack.extend(reversed(children))


def _text_problem(text: str) -> str | None:
    found = _UNSAFE_CHAR.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "contains a NUL character (\\u0000), which cannot be stored"
    return f"contains a lone surrogate (\\u{ord(found.group()):04x}), which is not valid Unicode"


def _join(path: str, key: Any) -> str:
    # Never echo a key as it came: it may hold the very NUL or surrogate being refused,
    # which the error response could not encode either.
    key = str(key)
    shown = key if _PLAIN_KEY.match(key) else json.dumps(key[:64])
    return f"{path}.{shown}" if path else shown


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]')
_SPACE = re.compile(r"[ \t\n\r]*")


def peek_member(data: bytes | str, name: str) -> Any:
    """The scalar value of the top-level member `name` of a JSON object that parse()
    refused as too deep, read without parsing the rest; None if there is none."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    depth, previous = 0, ""
    for token in _TOKEN.finditer(text):
        kind = token.group()
        if kind in ("[", "{"):
            depth += 1
        elif kind in ("]", "}"):
            depth -= 1
        elif kind == ":" and depth == 1 and previous.startswith('"') and _string(previous) == name:
            start = _SPACE.match(text, token.end()).end()  # type: ignore[union-attr]
            if text[start : start + 1] in ("[", "{", ""):
                return None  # not a scalar: nothing to read without parsing it
            try:
                value, _ = _DECODER.raw_decode(text, start)
            except ValueError:
                return None
            return None if isinstance(value, _Refused) else value
        previous = kind
    return None


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None

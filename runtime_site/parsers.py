"""DRF's JSON parser on common.json_safety, so every REST body is checked before a view sees it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# DRF defines get_encoding (rest_framework/parsers.py); its stubs do not declare it.
from rest_framework.parsers import JSONParser, get_encoding  # type: ignore[attr-defined]

from common import json_safety


class SafeJSONParser(JSONParser):
    """NUL, lone surrogates, NaN/Infinity, integers beyond 64 bits and deep nesting are a
    400 naming the field (runtime_site.errors), not a 500 from the write that meets them."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        return json_safety.loads(stream.read(), encoding=get_encoding(parser_context or {}))

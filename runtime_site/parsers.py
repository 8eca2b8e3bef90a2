"""DRF's JSON parser on common.json_safety, so every REST body is checked before a view sees it,
request fields that take only the JSON type they are documented with, and content negotiation
that names a ?format= it cannot serve."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer

if TYPE_CHECKING:
    from rest_framework.request import Request

# DRF defines get_encoding (rest_framework/parsers.py); its stubs do not declare it.
from rest_framework.parsers import JSONParser, get_encoding  # type: ignore[attr-defined]

from common import json_safety

# An Idempotency-Key header (POST /runtime/tasks) or a steering commandId.
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:\-]{1,200}\Z")  # \Z: "$" would let a trailing newline in


class SafeJSONParser(JSONParser):
    """NUL, lone surrogates, NaN/Infinity, integers beyond 64 bits and deep nesting are a
    400 naming the field (runtime_site.errors), not a 500 from the write that meets them."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        return json_safety.loads(stream.read(), encoding=get_encoding(parser_context or {}))


class StrictTypeMixin:
    """A field that takes only the JSON type its schema names. DRF's CharField turns 5 into "5"
    and its IntegerField "5" into 5: the served schema (runtime_site/openapi.py) says string
    and integer, so anything else is the 400 it promises."""

    json_types: tuple[type, ...] = ()

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, bool) or not isinstance(data, self.json_types):
            self.fail("invalid")  # type: ignore[attr-defined]
        return super().to_internal_value(data)  # type: ignore[misc]


class StrictCharField(StrictTypeMixin, serializers.CharField):
    json_types = (str,)


class StrictRegexField(StrictTypeMixin, serializers.RegexField):
    json_types = (str,)


class StrictIntegerField(StrictTypeMixin, serializers.IntegerField):
    json_types = (int,)


def refuse_paging(request: Request, listing: str) -> None:
    """A listing that answers every record at once takes no ?limit= or ?cursor=: ignored, a
    client paging through it (as through /runtime/tasks) would read one "page" of everything,
    or believe a limit it asked for held; a 400 naming the parameter tells it."""
    for name in ("limit", "cursor"):
        if name in request.query_params:
            raise ValidationError({name: f"{listing} is not paged: it answers every record at once; leave out {name}"})


class NamedFormatNegotiation(DefaultContentNegotiation):
    """?format= with a format no renderer of the view has is a 400 naming it. DRF raises
    Http404 there, which reads as "no such task" (runtime_site.errors) on a URL that is
    there, and on the schema came back as YAML."""

    def filter_renderers(self, renderers: Iterable[BaseRenderer], format: str) -> list[BaseRenderer]:
        renderers = list(renderers)
        kept = [renderer for renderer in renderers if renderer.format == format]
        if not kept:
            served = ", ".join(sorted({str(renderer.format) for renderer in renderers}))
            raise ValidationError({"format": f"{format!r} is not a format this URL answers in; one of {served}"})
        return kept

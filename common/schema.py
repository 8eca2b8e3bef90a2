"""JSON Schema validation with one error shape: the message names the offending field."""

from __future__ import annotations

from typing import Any

import jsonschema


class SchemaError(ValueError):
    """A document failed a JSON schema; the message names the offending field."""


def validate(document: Any, schema: dict[str, Any], what: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise SchemaError(f"{what} {where}: {error.message}")

"""config/runtime.yaml, overridable per key by the environment.

`runtime.lease_seconds` is overridden by RUNTIME_LEASE_SECONDS, `checkpoint.every_steps`
by CHECKPOINT_EVERY_STEPS, and so on: the section name, then the key, upper-cased.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from django.core.exceptions import ImproperlyConfigured

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "config" / "runtime.yaml"

# The seed's keys that state how the runtime always works rather than switch it: steering
# applies at safe points and accepts commands by compare-and-set on the task's version
# (steering_app/actions.py). Read here, so a deployment that sets another value is refused
# instead of silently running as if it had not.
INVARIANTS = {("steering", "apply_at_safe_point"): True, ("steering", "optimistic_concurrency"): True}


def _coerce(name: str, raw: str, like: Any) -> Any:
    """Parse an environment string into the type of the YAML default it replaces."""
    try:
        if isinstance(like, bool):
            if raw not in ("true", "false"):
                raise ValueError("use 'true' or 'false'")
            return raw == "true"
        if isinstance(like, int | float):
            number = float(raw)  # "0.5" is a fine lease for a test, even where the default is 30
            return int(number) if isinstance(like, int) and number.is_integer() else number
        if isinstance(like, list):
            return [item.strip() for item in raw.split(",") if item.strip()]
        if isinstance(like, dict):  # a mapping (llm.models) comes as JSON
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r}: {exc}") from exc
    return raw


def load(path: Path | None = None) -> dict[str, dict[str, Any]]:
    path = Path(os.getenv("RUNTIME_CONFIG", path or DEFAULT_PATH))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ImproperlyConfigured(f"cannot read runtime config {path}: {exc}") from exc
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ImproperlyConfigured(f"{path}: section {section!r} must be a mapping")
        for key, default in values.items():
            env_name = f"{section}_{key}".upper()
            if (raw := os.getenv(env_name)) not in (None, ""):
                values[key] = _coerce(env_name, raw, default)
    for (section, key), value in INVARIANTS.items():
        if data.get(section, {}).get(key, value) != value:
            raise ImproperlyConfigured(
                f"{section}.{key} must be {str(value).lower()}: the runtime always works this way (no other mode exists)"
            )
    return data

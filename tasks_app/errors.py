"""Domain errors every edge shares (docs/architecture.md, "Layers")."""

from __future__ import annotations


class TaskNotFound(Exception):
    """No such task for this caller: another tenant's task, a malformed id and a missing
    task are the same answer, so ids leak nothing."""

    def __init__(self, message: str = "no such task") -> None:
        super().__init__(message)


class Forbidden(Exception):
    """The caller's role (or its key's scopes) does not allow this; the message says why,
    and `role` names the role it needs when that is the reason."""

    def __init__(self, message: str, *, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role

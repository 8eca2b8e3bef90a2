"""API keys: `Authorization: Bearer rt_<prefix>_<secret>`, bound to one tenant and role."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from tasks_app.models import ROLE_RANK, ApiKey, Role, Tenant

KEY_PREFIX = "rt_"
# What issue_api_key makes: rt_<12 hex>_<token_urlsafe(32)>. Anything else is refused before
# the lookup, so no header (a NUL in it, say) ever reaches a query.
KEY_SHAPE = re.compile(r"rt_([0-9a-f]{12})_([A-Za-z0-9_\-]{16,128})\Z")


@dataclass(frozen=True)
class Principal:
    """Who is calling, for which tenant, with which role. `request.auth` carries it."""

    tenant: Tenant
    role: str
    actor: str  # the audit actor string

    def has_role(self, minimum: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(minimum)]


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_api_key(tenant: Tenant, user: User, *, role: str, name: str) -> tuple[ApiKey, str]:
    """Create a key and return it with the full token, which is never stored or shown again."""
    prefix, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    key = ApiKey.objects.create(tenant=tenant, user=user, role=role, name=name, prefix=prefix,
                                key_hash=_hash(secret))
    return key, f"{KEY_PREFIX}{prefix}_{secret}"


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request | HttpRequest) -> tuple[Any, Principal] | None:
        # Reads only headers, so the SSE and /mcp views call it with their plain Django request.
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <api key>'")
        shape = KEY_SHAPE.match(token.strip())
        if shape is None:
            raise exceptions.AuthenticationFailed("malformed API key: expected rt_<prefix>_<secret>")
        prefix, secret = shape.groups()
        key = ApiKey.objects.select_related("tenant", "user").filter(prefix=prefix, revoked_at__isnull=True).first()
        # compare_digest even on a miss would not hide much: prefixes are not secret.
        if key is None or not hmac.compare_digest(key.key_hash, _hash(secret)):
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return key.user, Principal(tenant=key.tenant, role=key.role, actor=f"user:{key.user_id}")

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="runtime"'  # makes DRF answer 401, not 403


def principal(request: Request) -> Principal:
    assert isinstance(request.auth, Principal)
    return request.auth


def require_role(minimum: str) -> type[permissions.BasePermission]:
    class HasRole(permissions.BasePermission):
        message = f"this needs the {minimum} role or above"

        def has_permission(self, request: Request, view: Any) -> bool:
            return isinstance(request.auth, Principal) and request.auth.has_role(minimum)

    return HasRole

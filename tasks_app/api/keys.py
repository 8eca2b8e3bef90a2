"""REST edge for API keys: list, create, rotate, revoke (the same lifecycle as the admin's).

A key manages its own user's keys in its tenant; a tenant admin's key also lists and revokes
the tenant's other keys (rotating one would hand the admin a key acting as its user). A key
never makes a key wider than itself, nor one that outlives it (auth.check_key_grant).
"""

from __future__ import annotations

from typing import Any, cast

from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runtime_site.parsers import StrictCharField, refuse_paging
from tasks_app.auth import (
    IsPrincipal,
    Principal,
    check_key_grant,
    check_may_revoke,
    issue_api_key,
    principal,
    revoke_api_key,
    rotate_api_key,
)
from tasks_app.models import ApiKey, Role, Scope, scopes_within


def key_body(key: ApiKey, token: str | None = None) -> dict[str, Any]:
    body = {
        "id": key.prefix,
        "name": key.name,
        "role": key.role,
        "scopes": key.scopes or None,
        "userId": key.user_id,
        "createdAt": key.created_at,
        "expiresAt": key.expires_at,
        "lastUsedAt": key.last_used_at,
        "revokedAt": key.revoked_at,
        "rotatedFrom": key.rotated_from.prefix if key.rotated_from else None,
    }
    if token is not None:
        body["token"] = token  # shown this once; only its hash is stored
    return body


def _field_of(exc: ValueError) -> str:
    """The request field a check_key_grant refusal is about."""
    text = str(exc)
    return "expiresAt" if "outlives" in text else "scopes" if "scope" in text else "role"


def manageable_keys(who: Principal, user_id: Any) -> Any:
    keys = ApiKey.objects.filter(tenant=who.tenant).select_related("rotated_from").order_by("-created_at")
    return keys if who.has_role(Role.ADMIN) else keys.filter(user_id=user_id)


NO_SUCH_KEY = "no such key among those this key may manage"


def manageable_key(request: Request, key_id: str) -> ApiKey:
    """Another user's key (for a non-admin) or another tenant's is the same 404 as none."""
    key = manageable_keys(principal(request), request.user.pk).filter(prefix=key_id).first()
    if key is None:
        raise NotFound(NO_SUCH_KEY)
    return key


class KeyListCreateApi(APIView):
    permission_classes = [IsPrincipal]

    class InputSerializer(serializers.Serializer):
        name = StrictCharField(max_length=100)  # a number is no name: DRF's CharField stored 5 as "5"
        role = serializers.ChoiceField(choices=Role.choices, required=False)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=Scope.choices), required=False, allow_empty=False
        )
        expiresAt = serializers.DateTimeField(required=False)  # noqa: N815 (wire names)

    def get(self, request: Request) -> Response:
        refuse_paging(request, "the key listing")
        return Response({"keys": [key_body(k) for k in manageable_keys(principal(request), request.user.pk)]})

    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body, who = data.validated_data, principal(request)
        role = body.get("role", who.role)
        # A narrow key's child is at most as narrow: it inherits the maker's scopes by default,
        # those its role allows (a key wider than its user's membership acts, and makes keys,
        # with the membership's role: its other scopes are not the new key's to carry).
        scopes = body.get("scopes") or (sorted(who.scopes & scopes_within(role)) if who.scopes is not None else None)
        # ... and expires with it by default (a key, or an access token, that expires).
        expires = body.get("expiresAt", who.expires_at)
        if expires is not None and expires <= timezone.now():
            raise ValidationError({"expiresAt": "must be in the future"})
        try:
            check_key_grant(role, scopes, expires_at=expires, granted_by=who)
        except ValueError as exc:
            raise ValidationError({_field_of(exc): str(exc)}) from None
        # cast: IsPrincipal let only an authenticated user through.
        key, token = issue_api_key(
            who.tenant, cast(User, request.user), role=role, name=body["name"], scopes=scopes, expires_at=expires
        )
        return Response(key_body(key, token), status=status.HTTP_201_CREATED)


class KeyDetailApi(APIView):
    permission_classes = [IsPrincipal]

    def get(self, request: Request, key_id: str) -> Response:
        return Response(key_body(manageable_key(request, key_id)))

    def delete(self, request: Request, key_id: str) -> Response:
        """Revoke: the key stops working on its next request."""
        key = manageable_key(request, key_id)
        try:
            check_may_revoke(key, principal(request))
        except ValueError as exc:
            raise PermissionDenied(str(exc)) from None
        revoke_api_key(key)
        key.refresh_from_db()
        return Response(key_body(key))


class KeyRotateApi(APIView):
    """POST /runtime/keys/{id}/rotate: a new key with the same grant; the old one keeps working
    for security.key_rotation_grace_seconds, then expires: two keys are live while holders switch."""

    permission_classes = [IsPrincipal]

    def post(self, request: Request, key_id: str) -> Response:
        key = manageable_key(request, key_id)
        if key.user_id != request.user.pk:
            # The new token is the caller's to hold: another user's would let an admin act as
            # them (their actor in the audit, their approvals). An admin revokes it instead.
            raise PermissionDenied("only a key's own user may rotate it; a tenant admin may revoke it")
        try:
            # The caller gets the new key: it may be no wider than the caller's own (a read-only
            # key must not rotate its user's full key into its hands).
            check_key_grant(key.role, key.scopes, expires_at=key.expires_at, granted_by=principal(request))
        except ValueError as exc:  # nothing wrong with the request: this caller may not do it
            raise PermissionDenied(f"this key may not rotate {key.prefix}: {exc}") from None
        try:
            new, token = rotate_api_key(key)
        except ValueError as exc:  # revoked meanwhile
            raise ValidationError({"id": str(exc)}) from None
        return Response(
            {**key_body(new, token), "previous": key_body(ApiKey.objects.get(pk=key.pk))},
            status=status.HTTP_201_CREATED,
        )

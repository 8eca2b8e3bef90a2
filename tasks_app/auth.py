"""API keys: `Authorization: Bearer rt_<prefix>_<secret>`, bound to one tenant and role."""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, models, transaction
from django.db.models import OuterRef, Q, Subquery
from django.http import HttpRequest
from django.utils import timezone
from psycopg import sql
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from common.canonical import sha256_hex
from runtime_site import ratelimit
from tasks_app import oauth
from tasks_app.errors import Forbidden
from tasks_app.models import ROLE_RANK, ROLE_SCOPES, ApiKey, Membership, Role, Scope, Tenant, from_rows, scopes_within

KEY_PREFIX = "rt_"
# What issue_api_key makes: rt_<12 hex>_<token_urlsafe(32)>. Anything else is refused before
# the lookup, so no header (a NUL in it, say) ever reaches a query.
KEY_SHAPE = re.compile(r"rt_([0-9a-f]{12})_([A-Za-z0-9_\-]{16,128})\Z")


# last_used_at is a hint for people deciding which keys to revoke, not an access log: it is
# written when it is this much out of date, so a busy key costs one UPDATE a minute, not one
# per request.
LAST_USED_EVERY = timedelta(minutes=1)


@dataclass(frozen=True)
class Principal:
    """Who is calling, for which tenant, with which role. `request.auth` carries it.

    `scopes` narrows an API key below its role (None: a person, who has their role's all)."""

    tenant: Tenant
    role: str
    actor: str  # the audit actor string
    scopes: frozenset[str] | None = None
    key: str | None = None  # the API key's prefix (its public id); None for a person's session
    expires_at: datetime | None = None  # when the key (or access token) stops working; None: it does not

    def has_role(self, minimum: str) -> bool:
        """The role's rank, and for a key the scope that power needs: every role check of
        every edge (REST, MCP, dashboard, steering's answer rule) comes through here."""
        if ROLE_RANK[Role(self.role)] < ROLE_RANK[Role(minimum)]:
            return False
        return self.scopes is None or ROLE_SCOPES[minimum] <= self.scopes


def _hash(secret: str) -> str:
    return sha256_hex(secret)


def effective_scopes(role: str, scopes: list[str] | frozenset[str]) -> frozenset[str]:
    """A key's stored scopes, or all its role allows when it names none."""
    return frozenset(scopes) & scopes_within(role) if scopes else scopes_within(role)


def check_key_grant(
    role: str, scopes: list[str] | None, *, expires_at: datetime | None = None, granted_by: Principal | None = None
) -> None:
    """A key's role and scopes must fit each other and, when a key makes a key (or rotates one,
    which hands the caller a new key with the rotated one's grant), the maker's own: no key can
    mint a wider one, nor one that outlives it. Raises ValueError naming the problem."""
    if role not in Role.values:
        raise ValueError(f"unknown role {role!r}")
    unknown = set(scopes or []) - set(Scope.values)
    if unknown:
        raise ValueError(f"unknown scopes {sorted(unknown)}: use {Scope.values}")
    beyond = set(scopes or []) - scopes_within(role)
    if beyond:
        raise ValueError(f"scopes {sorted(beyond)} are beyond the {role} role")
    if granted_by is not None:
        if ROLE_RANK[Role(role)] > ROLE_RANK[Role(granted_by.role)]:
            raise ValueError(f"a {granted_by.role} may not make a {role} key")
        wanted = effective_scopes(role, scopes or [])
        if granted_by.scopes is not None and not wanted <= granted_by.scopes:
            raise ValueError(f"scopes {sorted(wanted - granted_by.scopes)} are beyond this key's own")
        ends = granted_by.expires_at
        if ends is not None and (expires_at is None or expires_at > ends):
            raise ValueError(f"a key that expires at {ends.isoformat()} may not make one that outlives it")


def check_may_revoke(key: ApiKey, who: Principal) -> None:
    """A key may always revoke itself; another key only if it can do nothing the caller
    cannot (its scopes within the caller's): a narrow key that leaked (a read-only exporter's)
    must not switch off its user's wider keys. ValueError naming what the key has beyond."""
    if who.key == key.prefix:
        return
    own = who.scopes if who.scopes is not None else scopes_within(who.role)
    beyond = effective_scopes(key.role, key.scopes) - own
    if beyond:
        raise ValueError(f"key {key.prefix} has scopes {sorted(beyond)} beyond this caller's; it may not revoke it")


def issue_api_key(
    tenant: Tenant,
    user: User,
    *,
    role: str,
    name: str,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    rotated_from: ApiKey | None = None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with the full token, which is never stored or shown again."""
    check_key_grant(role, scopes)
    prefix, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        tenant=tenant,
        user=user,
        role=role,
        name=name,
        prefix=prefix,
        key_hash=_hash(secret),
        scopes=sorted(scopes or []),
        expires_at=expires_at,
        rotated_from=rotated_from,
    )
    return key, f"{KEY_PREFIX}{prefix}_{secret}"


def rotate_api_key(old: ApiKey, *, grace: timedelta | None = None) -> tuple[ApiKey, str]:
    """A new key like `old`; `old` keeps working for `grace` (security.key_rotation_grace_seconds)
    so its holders can switch over without an outage, then expires. Two keys are live meanwhile."""
    if grace is None:
        grace = timedelta(seconds=settings.RUNTIME["security"].get("key_rotation_grace_seconds", 86400))
    with transaction.atomic():
        old = ApiKey.objects.select_for_update().get(pk=old.pk)
        if old.revoked_at is not None:
            raise ValueError("a revoked key cannot be rotated")
        new, token = issue_api_key(
            old.tenant,
            old.user,
            role=old.role,
            name=old.name,
            scopes=old.scopes,
            expires_at=old.expires_at,
            rotated_from=old,
        )
        ends = timezone.now() + grace
        if old.expires_at is None or old.expires_at > ends:
            old.expires_at = ends
            old.save(update_fields=["expires_at"])
    return new, token


def revoke_api_key(key: ApiKey) -> None:
    ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())


def _member_role() -> Subquery:
    return Subquery(Membership.objects.filter(tenant=OuterRef("tenant"), user=OuterRef("user")).values("role")[:1])


def parse_key(token: str) -> tuple[str, str]:
    """(prefix, secret) of an API key; AuthenticationFailed for anything not shaped like one."""
    shape = KEY_SHAPE.match(token.strip())
    if shape is None:
        raise exceptions.AuthenticationFailed("malformed API key: expected rt_<prefix>_<secret>")
    prefix, secret = shape.groups()
    return prefix, secret


def authenticate_key(token: str) -> tuple[Any, Principal]:
    """The one check every edge's API key goes through (REST, /mcp, SSE): the key exists, is
    neither revoked nor expired, its user is active and still a member of its tenant, and it
    acts with the lower of its own role and the membership's, within its scopes. Read on
    every request, so a deactivation or a lost membership takes effect on the next one."""
    prefix, secret = parse_key(token)
    key = read_key(prefix)
    now = timezone.now()
    who = check_key(key, secret, now)
    assert key is not None  # check_key refuses a missing key
    if last_use_stale(key, now):
        # Conditional, so concurrent requests of one key write once between them.
        (
            ApiKey.objects.filter(pk=key.pk)
            .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lte=now - LAST_USED_EVERY))
            .update(last_used_at=now)
        )
    return key.user, who


def read_key(prefix: str) -> ApiKey | None:
    """The key with this prefix as check_key reads it: with its tenant, its user's is_active
    and the membership's role (`member_role`). On PostgreSQL the statement written out below
    (KEY_SQL): compiling the ORM's, with its join and subquery, was a fifth of a steering
    request's CPU time (issue 14)."""
    if connection.vendor != "postgresql":
        return (
            ApiKey.objects.select_related("tenant", "user")
            .annotate(member_role=_member_role())
            .filter(prefix=prefix)
            .first()
        )
    with connection.cursor() as cursor:
        cursor.execute(_KEY_SQL_TEXT, {"prefix": prefix})
        row = cursor.fetchone()
    return None if row is None else key_from_row(row, decoded=False)


def select_list(model: type[models.Model], alias: str, names: list[str]) -> tuple[list[str], sql.Composable]:
    """(attnames, SELECT list) of the fields `names`, in the model's order, which from_db() expects."""
    fields = [f for f in model._meta.concrete_fields if f.name in names]
    assert len(fields) == len(names), (model, names)
    identifiers: list[sql.Composable] = [sql.Identifier(alias, str(f.column)) for f in fields]
    return [f.attname for f in fields], sql.Composed(identifiers).join(", ")


_key_names, _key_columns = select_list(
    ApiKey,
    "k",
    ["id", "tenant", "user", "role", "prefix", "key_hash", "scopes", "expires_at", "revoked_at", "last_used_at"],
)
_tenant_names, _tenant_columns = select_list(Tenant, "tn", ["id", "slug", "name", "created_at"])
# The user as select_related read it, but its password hash (deferred: read if ever asked for).
_user_names, _user_columns = select_list(
    User, "u", [f.name for f in User._meta.concrete_fields if f.name != "password"]
)

# What read_key reads (KEY_COLUMNS from KEY_TABLES), and the lean read path
# (tasks_app/api/lean.py) with the task beside it: key_from_row makes the key of it.
KEY_COLUMNS = sql.SQL("{key}, {user}, m.role, {tenant}").format(
    key=_key_columns, user=_user_columns, tenant=_tenant_columns
)
KEY_TABLES = sql.SQL("""tasks_app_apikey k
      JOIN auth_user u ON u.id = k.user_id
      JOIN tasks_app_tenant tn ON tn.id = k.tenant_id
      LEFT JOIN tasks_app_membership m ON m.tenant_id = k.tenant_id AND m.user_id = k.user_id""")
KEY_SQL = sql.SQL("SELECT {columns} FROM {tables} WHERE k.prefix = %(prefix)s").format(
    columns=KEY_COLUMNS, tables=KEY_TABLES
)
# As text, composed once: Django's cursor and whatever wraps it (an execute_wrapper, tracing)
# expect a string, not psycopg's Composed.
_KEY_SQL_TEXT = KEY_SQL.as_string(None)
KEY_WIDTH = len(_key_names) + len(_user_names) + 1 + len(_tenant_names)  # the row's columns that are the key's


def key_from_row(row: Sequence[Any], *, decoded: bool) -> ApiKey:
    """The key of a row that starts with KEY_COLUMNS, as read_key's ORM read makes it.
    decoded: the row holds Python values already (psycopg's own loaders, which the lean
    path's pool keeps); Django's connection leaves JSON as text for the ORM to decode."""

    def make[M: models.Model](model: type[M], names: list[str], values: Sequence[Any]) -> M:
        return model.from_db("default", names, list(values)) if decoded else from_rows(model, names, [values])[0]

    k, u = len(_key_names), len(_key_names) + len(_user_names)
    key = make(ApiKey, _key_names, row[:k])
    key.user = make(User, _user_names, row[k:u])
    key.member_role = row[u]  # type: ignore[attr-defined]  # _member_role's annotation
    key.tenant = make(Tenant, _tenant_names, row[u + 1 : KEY_WIDTH])
    return key


def check_key(key: ApiKey | None, secret: str, now: datetime) -> Principal:
    """The rules of authenticate_key over a key as read (with its tenant, its user and the
    `member_role` annotation), apart from the read: the lean read path (tasks_app/api/lean.py)
    reads the same row in its own query and asks the same rules."""
    # compare_digest even on a miss would not hide much: prefixes are not secret.
    if key is None or not hmac.compare_digest(key.key_hash, _hash(secret)) or key.revoked_at is not None:
        raise exceptions.AuthenticationFailed("invalid or revoked API key")
    # The holder proved the secret: they may know why it stopped working.
    if key.expires_at is not None and key.expires_at <= now:
        raise exceptions.AuthenticationFailed("this API key has expired")
    if not key.user.is_active:
        raise exceptions.AuthenticationFailed("this API key's user is deactivated")
    member_role = getattr(key, "member_role", None)
    if member_role is None:
        raise exceptions.AuthenticationFailed("this API key's user is no longer a member of its tenant")
    role = min(key.role, member_role, key=lambda r: ROLE_RANK[Role(r)])
    return Principal(
        tenant=key.tenant,
        role=role,
        actor=f"user:{key.user_id}",
        scopes=effective_scopes(key.role, key.scopes),
        key=key.prefix,
        expires_at=key.expires_at,
    )


def last_use_stale(key: ApiKey, now: datetime) -> bool:
    """Whether this use of the key should be written to last_used_at (LAST_USED_EVERY)."""
    return key.last_used_at is None or now - key.last_used_at >= LAST_USED_EVERY


class MalformedAuthorization(exceptions.AuthenticationFailed):
    """An Authorization header that is not `Bearer <credential>`: RFC 6750's invalid_request."""


def bearer_token(request: Request | HttpRequest) -> str | None:
    """The request's bearer credential; None without an Authorization header."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise MalformedAuthorization("Authorization header must be 'Bearer <api key>'")
    return token.strip()


def challenge(request: Any, refusal: Exception | None = None) -> str:
    """The WWW-Authenticate of a 401 (or of a token's 403) on every edge, REST, SSE and /mcp
    (RFC 6750 §3): a Bearer challenge naming the protected resource metadata (RFC 9728);
    no error code when no credential came (`refusal` None or NotAuthenticated), invalid_request
    for an Authorization header that is no bearer credential, invalid_token for one that does
    not work (unknown, malformed, revoked, expired, a bad JWT), insufficient_scope for a good
    token that grants nothing here."""
    detail = str(getattr(refusal, "detail", refusal))
    if isinstance(refusal, MalformedAuthorization):
        return oauth.challenge(request, "invalid_request", detail)
    if isinstance(refusal, exceptions.AuthenticationFailed):
        return oauth.challenge(request, "invalid_token", detail)
    if isinstance(refusal, oauth.TokenForbidden):
        return oauth.challenge(request, "insufficient_scope", detail)
    return oauth.challenge(request)  # no credential came (NotAuthenticated, None)


OAUTH_KEY_PREFIX = "oauth-"  # a token's Principal.key: what rate limits count it by


def scope_challenge(request: Any, who: Any, refusal: Exception) -> str | None:
    """The WWW-Authenticate of a 403 that more scope would lift (RFC 6750 §3.1, MCP
    authorization's scope challenge): error="insufficient_scope" and the scope to ask for,
    the issuer's for a token, the key scope for an API key. None when the refusal is not
    a role check (`refusal.role`), or the credential has the scopes and its user's membership
    falls short (the membership caps the role, never the scopes: no token would help, and a
    client must not be sent round asking)."""
    minimum = getattr(refusal, "role", None)
    if not isinstance(who, Principal) or who.scopes is None or minimum is None:
        return None
    missing = ROLE_SCOPES[minimum] - who.scopes
    if not missing:
        return None
    token = (who.key or "").startswith(OAUTH_KEY_PREFIX)
    names = oauth.scopes_granting(frozenset(missing)) if token else sorted(missing)
    return oauth.challenge(request, "insufficient_scope", str(refusal), scope=" ".join(names))


def authenticate_token(token: str) -> tuple[Any, Principal]:
    """An API key, or the configured issuer's bearer JWT (tasks_app/oauth.py). Also what a
    long-lived stream asks again while it is open: a key revoked since closes it."""
    if not token.startswith(KEY_PREFIX) and oauth.enabled() and oauth.looks_like_jwt(token):
        grant = oauth.authenticate_jwt(token)
        # key: what rate limits count by, per token subject (never the token, which is renewed)
        key = f"{OAUTH_KEY_PREFIX}{grant.user.pk}"
        return grant.user, Principal(
            grant.tenant, grant.role, f"user:{grant.user.pk}", grant.scopes, key=key, expires_at=grant.expires_at
        )
    return authenticate_key(token)


def reauthenticate(token: str) -> Principal | None:
    """The credential a long-lived stream was opened with (SSE, an MCP subscriptions/listen or
    blocking tasks/result), asked again every stream.auth_recheck_seconds: who it speaks for
    now, or None once it no longer works (revoked, expired, its user deactivated or out of the
    tenant, a token whose grant is gone). Not rate limited: the stream's request was.

    Raises oauth.IssuerUnavailable when the token's issuer cannot be read now (and the
    database's error when it cannot answer): no verdict on the token, so the stream ends
    "unavailable, retry" (tasks_app.faults), never as if the token had been revoked."""
    try:
        return authenticate_token(token)[1]
    except (exceptions.AuthenticationFailed, exceptions.PermissionDenied):
        return None


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request | HttpRequest) -> tuple[Any, Principal] | None:
        # Reads only headers, so the SSE and /mcp views call it with their plain Django request.
        address = ratelimit.client_address(request)
        try:
            token = bearer_token(request)
            if token is None:
                return None
            # An address past its failure limit is refused before its credential costs a
            # lookup and a hash, or a token an RSA verification: 429, not another 401.
            ratelimit.check_address(address)
            user, who = authenticate_token(token)
        except exceptions.AuthenticationFailed:
            ratelimit.count_failure(address)  # raises AuthFailuresLimited past the limit
            raise
        # Counted once the key is proven: a stranger who knows a key's (public) prefix
        # cannot spend its owner's allowance. RateLimited is DRF's 429 with Retry-After;
        # /mcp and the SSE view turn it into their own 429s.
        ratelimit.enforce(who, ratelimit.surface_of(request.path))
        return user, who

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401, not 403; runtime_site.errors puts challenge(request, exc) in
        # its place, which knows whether a credential came and why it was refused.
        return challenge(request)


def principal(request: Request) -> Principal:
    assert isinstance(request.auth, Principal)
    return request.auth


def require_role(minimum: str) -> type[permissions.BasePermission]:
    class HasRole(permissions.BasePermission):
        message = f"this needs the {minimum} role or above"

        def has_permission(self, request: Request, view: Any) -> bool:
            if not isinstance(request.auth, Principal):
                return False  # DRF answers 401: no credential came
            if not request.auth.has_role(minimum):
                # The domain error, not DRF's bare 403: it names the role, so the answer can
                # say which scope would lift it (scope_challenge), as every other edge does.
                raise Forbidden(self.message, role=minimum)
            return True

    return HasRole


class IsPrincipal(permissions.BasePermission):
    """Any authenticated caller; the action itself decides (tasks_app.access.answer_refusal)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.auth, Principal)

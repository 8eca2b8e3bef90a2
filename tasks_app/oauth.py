"""Bearer JWTs from one configured OAuth issuer (config/runtime.yaml `oauth`), beside API
keys: MCP authorization of the 2026-07-28 specification (docs/security.md).

A token is a signed JWT (RFC 9068 style) the issuer made for this server: its signature
checks against a key of the issuer's JWKS (fetched over HTTPS, cached, and fetched again
when a token names a key id the cache does not have, at most once per
`jwks_refresh_seconds`), `iss` is the issuer, `aud` names this server, `exp` (and `nbf`)
hold. Only asymmetric algorithms are accepted, so `alg: none` and an HMAC signed with the
public key are refused, and a token is verified only with the algorithm its key is for: the
key's `alg` when the JWKS names one (RFC 7517 §4.4), else one of its key type's (RSA: RS*
and PS*, EC: the ES* of its curve, OKP: EdDSA); a header naming any other is refused before
the signature is looked at. Then the claims map onto the runtime: `sub` (or `user_claim`) is
a user by username, the tenant claim a tenant by slug, and the token's OAuth scopes the
runtime's role and scopes (`scopes`: {oauth scope: read | operate | approve | admin}),
capped, like an API key, by the user's membership role.

Every failure is AuthenticationFailed (401, the token is no good), TokenForbidden (403, a
good token that grants nothing here) or IssuerUnavailable (503, the issuer's keys cannot be
read now); nothing a caller sends can make a 500, and a slow issuer holds a request for at
most one fetch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx
import jwt
from django.conf import settings
from django.contrib.auth.models import User
from rest_framework import exceptions

from tasks_app.models import ROLE_RANK, Membership, Role, Scope, Tenant

logger = logging.getLogger(__name__)

# Asymmetric only: the issuer signs, we hold nothing secret (no HS*, never none).
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
MAX_TOKEN_BYTES = 8192  # far above any real access token; a bigger header is never parsed
MAX_JWKS_BYTES = 256 * 1024
JWKS_TIMEOUT = 5.0  # one fetch of the issuer's keys, in all
FAILED_FETCH_BACKOFF = 5.0  # after a failed fetch the issuer is not asked again for this long
ADMIN = "admin"  # a mapping value: every scope and the admin role


class TokenForbidden(exceptions.PermissionDenied):
    """A valid token that grants nothing here (unknown tenant or user, no membership, no
    mapped scope): 403, with WWW-Authenticate error="insufficient_scope" where it fits."""


def config() -> dict[str, Any]:
    return settings.RUNTIME.get("oauth", {}) or {}


def enabled() -> bool:
    """On once an issuer, its JWKS and this server's identifier (resource) are configured."""
    cfg = config()
    return bool(cfg.get("issuer") and cfg.get("jwks_uri") and audience())


METADATA_PATH = "/.well-known/oauth-protected-resource"


def resource(request: Any) -> str:
    """This server's resource identifier (RFC 8707): configured, or the request's /mcp URL."""
    return str(config().get("resource") or request.build_absolute_uri("/mcp"))


def metadata(request: Any) -> dict[str, Any]:
    """The protected resource metadata (RFC 9728) of /mcp (and of /runtime/, which takes the same tokens)."""
    cfg = config()
    body: dict[str, Any] = {
        "resource": resource(request),
        "bearer_methods_supported": ["header"],
        "resource_name": "Agent Runtime",
        "scopes_supported": sorted(cfg.get("scopes") or {}),
    }
    if enabled():
        body["authorization_servers"] = [str(cfg["issuer"])]
    return body


def challenge(request: Any, error: str | None = None, description: str | None = None, scope: str = "") -> str:
    """The WWW-Authenticate of a 401 or 403: where the metadata is (MCP authorization),
    and with a token that failed, why (RFC 6750 error codes); with insufficient_scope, the
    scope to ask for (`scope`)."""
    parts = ['realm="runtime"', f'resource_metadata="{request.build_absolute_uri(METADATA_PATH)}"']
    if error:
        parts.append(f'error="{error}"')
    if description:
        clean = "".join(c for c in description if c.isprintable() and c not in '"\\')[:200]
        parts.append(f'error_description="{clean}"')
    if scope:
        parts.append(f'scope="{scope}"')
    return "Bearer " + ", ".join(parts)


def scopes_granting(needed: frozenset[str]) -> list[str]:
    """The issuer's scopes (oauth.scopes) a token needs for the runtime scopes `needed`: each
    one's own mapped scope, or the admin scope for one that has none."""
    mapping: dict[str, str] = config().get("scopes") or {}
    names = {name for name, power in mapping.items() if power in needed}
    if not needed <= {mapping[name] for name in names}:
        names |= {name for name, power in mapping.items() if power == ADMIN}
    return sorted(names)


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2


# The algorithms a key may verify when its JWK names none, by key type and curve.
KEY_TYPE_ALGORITHMS: dict[tuple[str, str | None], frozenset[str]] = {
    ("RSA", None): frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}),
    ("EC", "P-256"): frozenset({"ES256"}),
    ("EC", "P-384"): frozenset({"ES384"}),
    ("EC", "P-521"): frozenset({"ES512"}),
    ("OKP", "Ed25519"): frozenset({"EdDSA"}),
    ("OKP", "Ed448"): frozenset({"EdDSA"}),
}


@dataclass(frozen=True)
class SigningKey:
    """A key of the issuer's JWKS and the algorithms it may verify (RFC 7517 §4.4 `alg`)."""

    jwk: jwt.PyJWK
    algorithms: frozenset[str]


def key_algorithms(raw: dict[str, Any]) -> frozenset[str]:
    """The JWK's own `alg`, or its key type's algorithms when it names none."""
    if isinstance(raw.get("alg"), str):
        return frozenset({raw["alg"]})
    crv = raw.get("crv") if raw.get("kty") != "RSA" else None
    return KEY_TYPE_ALGORITHMS.get((str(raw.get("kty")), crv if isinstance(crv, str) else None), frozenset())


@dataclass(frozen=True)
class _KeySet:
    keys: dict[str, SigningKey]
    fetched_at: float  # the last fetch that worked (time.monotonic()), -inf before the first
    tried_at: float  # the last fetch, whether it worked or not
    failed: bool = False  # the last fetch did not work: the keys are the ones from before

    def due(self, cfg: dict[str, Any], now: float) -> bool:
        """Whether to ask the issuer, for a kid missing from `keys` or keys gone stale."""
        if self.failed:
            return now - self.tried_at >= FAILED_FETCH_BACKOFF
        if now - self.fetched_at >= float(cfg.get("jwks_cache_seconds", 300)):
            return True
        return now - self.tried_at >= float(cfg.get("jwks_refresh_seconds", 30))


_NONE_YET = _KeySet({}, float("-inf"), float("-inf"))
_cache: dict[str, _KeySet] = {}
_fetch_locks: dict[str, threading.Lock] = {}
_lock = threading.Lock()  # guards _fetch_locks


class IssuerUnavailable(exceptions.APIException):
    """The issuer's keys cannot be fetched now and none cached verifies the token: 503 with
    Retry-After. Not the token's fault, so not a 401, which tells a client to drop it."""

    status_code = 503
    default_code = "issuer_unavailable"
    default_detail = "the issuer's signing keys cannot be fetched now; retry shortly"
    wait = int(FAILED_FETCH_BACKOFF)  # DRF's handler sends it as Retry-After


def _fetch(uri: str) -> dict[str, SigningKey]:
    """The issuer's signing keys by kid. ValueError for anything but a key set within
    MAX_JWKS_BYTES and JWKS_TIMEOUT in all (a server trickling bytes cannot hold us longer)."""
    deadline = time.monotonic() + JWKS_TIMEOUT
    with httpx.Client(timeout=JWKS_TIMEOUT, follow_redirects=False) as client, client.stream("GET", uri) as response:
        response.raise_for_status()
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_JWKS_BYTES:
                raise ValueError(f"the JWKS at {uri} is larger than {MAX_JWKS_BYTES} bytes")
            if time.monotonic() > deadline:
                raise ValueError(f"the JWKS at {uri} took longer than {JWKS_TIMEOUT:g} s")
    document = json.loads(body)
    if not isinstance(document, dict) or not isinstance(document.get("keys", []), list):
        raise ValueError(f"the JWKS at {uri} is not a key set ({{'keys': [...]}})")
    keys: dict[str, SigningKey] = {}
    for raw in document.get("keys", []):
        if not isinstance(raw, dict) or raw.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK.from_dict(raw)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
            continue  # a key type or curve we do not use: the others still count
        keys[str(raw.get("kid", ""))] = SigningKey(key, key_algorithms(raw) & frozenset(ALGORITHMS))
    return keys


def _refresh(uri: str, seen: _KeySet) -> _KeySet:
    """Fetch the key set again, one request at a time per JWKS: the others wait for that
    fetch and take its outcome, so a slow issuer costs each request at most one fetch's
    timeout, never its place in a queue of fetches. A failed fetch keeps the keys from
    before and is not tried again for FAILED_FETCH_BACKOFF."""
    with _lock:
        fetch_lock = _fetch_locks.setdefault(uri, threading.Lock())
    if not fetch_lock.acquire(timeout=JWKS_TIMEOUT):
        return replace(_cache.get(uri, _NONE_YET), failed=True)  # still fetching: the issuer is slow
    try:
        current = _cache.get(uri, _NONE_YET)
        if current.tried_at > seen.tried_at:
            return current  # fetched (or failed) while this request waited
        now = time.monotonic()
        try:
            current = _KeySet(_fetch(uri), now, now)
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("oauth: cannot fetch the issuer's JWKS from %s: %s", uri, exc)
            current = replace(current, tried_at=now, failed=True)
        _cache[uri] = current
        return current
    finally:
        fetch_lock.release()


def signing_key(kid: str) -> SigningKey:
    """The issuer's key `kid`, from the cache; an unknown kid fetches the JWKS again (the
    issuer rotated), but not more often than jwks_refresh_seconds: random kids in forged
    tokens must not turn us into a flood against the issuer. While the issuer cannot be
    read, the keys it published last go on verifying tokens; a kid not among them is
    IssuerUnavailable (503), since the issuer may well have published it."""
    cfg = config()
    uri = str(cfg["jwks_uri"])
    keys, now = _cache.get(uri, _NONE_YET), time.monotonic()
    fresh = now - keys.fetched_at < float(cfg.get("jwks_cache_seconds", 300))
    if not (fresh and kid in keys.keys) and keys.due(cfg, now):
        keys = _refresh(uri, keys)
    if kid in keys.keys:
        return keys.keys[kid]
    if keys.failed:
        raise IssuerUnavailable()
    raise exceptions.AuthenticationFailed("the token is signed with a key the issuer does not publish")


def audience() -> str:
    cfg = config()
    return str(cfg.get("audience") or cfg.get("resource") or "")


def claims_of(token: str) -> dict[str, Any]:
    """The verified claims, or AuthenticationFailed saying what is wrong (never why in detail
    that would help a forger: 'invalid signature', not which byte)."""
    cfg = config()
    if len(token) > MAX_TOKEN_BYTES:
        raise exceptions.AuthenticationFailed("the token is too large")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise exceptions.AuthenticationFailed("the token is not a JWT") from None
    allowed = [a for a in cfg.get("algorithms") or ALGORITHMS if a in ALGORITHMS]
    if header.get("alg") not in allowed:
        raise exceptions.AuthenticationFailed(f"the token's algorithm must be one of {', '.join(allowed)}")
    key = signing_key(str(header.get("kid", "")))
    if header["alg"] not in key.algorithms:
        # An RS256 key's token signed PS256, say: not what the issuer published the key for.
        raise exceptions.AuthenticationFailed("the token's algorithm is not the one its signing key is for")
    try:
        return jwt.decode(
            token,
            key=key.jwk.key,
            algorithms=[header["alg"]],
            audience=audience(),
            issuer=str(cfg["issuer"]),
            leeway=float(cfg.get("leeway_seconds", 30)),
            options={"require": ["exp", "iss", "aud", "sub"], "verify_nbf": True},
        )
    except jwt.ExpiredSignatureError:
        raise exceptions.AuthenticationFailed("the token has expired") from None
    except jwt.InvalidAudienceError:
        raise exceptions.AuthenticationFailed("the token is not for this server (aud)") from None
    except jwt.InvalidIssuerError:
        raise exceptions.AuthenticationFailed("the token is not from the configured issuer (iss)") from None
    except jwt.ImmatureSignatureError:
        raise exceptions.AuthenticationFailed("the token is not valid yet (nbf)") from None
    except jwt.MissingRequiredClaimError as exc:
        raise exceptions.AuthenticationFailed(f"the token has no {exc.claim} claim") from None
    except (jwt.PyJWTError, ValueError, TypeError):
        raise exceptions.AuthenticationFailed("invalid token (signature or format)") from None


def granted(claims: dict[str, Any]) -> tuple[str, frozenset[str]]:
    """(role, scopes) from the token's `scope` (space-separated) or `scp` (a list)."""
    raw = claims.get("scope", claims.get("scp", ""))
    token_scopes = (
        set(raw.split())
        if isinstance(raw, str)
        else {s for s in raw if isinstance(s, str)}
        if isinstance(raw, list)
        else set()
    )
    mapping: dict[str, str] = config().get("scopes") or {}
    mapped = {mapping[s] for s in token_scopes if s in mapping}
    if ADMIN in mapped:
        return Role.ADMIN, frozenset(Scope)
    scopes = frozenset(mapped) & frozenset(Scope)
    if not scopes:
        raise TokenForbidden("the token carries none of this server's scopes")
    for role, needs in ((Role.APPROVER, Scope.APPROVE), (Role.OPERATOR, Scope.OPERATE), (Role.VIEWER, Scope.READ)):
        if needs in scopes:
            return role, scopes
    raise AssertionError("unreachable: scopes is a non-empty subset of Scope")


@dataclass(frozen=True)
class Grant:
    """Who a verified token speaks for (tasks_app.auth makes the Principal)."""

    user: User
    tenant: Tenant
    role: str
    scopes: frozenset[str]
    expires_at: datetime  # the token's exp


def authenticate_jwt(token: str) -> Grant:
    cfg = config()
    claims = claims_of(token)
    tenant_slug = claims.get(str(cfg.get("tenant_claim") or "tenant"))
    username = claims.get(str(cfg.get("user_claim") or "sub"))
    if not isinstance(tenant_slug, str) or not isinstance(username, str):
        raise exceptions.AuthenticationFailed("the token names no tenant or user")
    role, scopes = granted(claims)
    tenant = Tenant.objects.filter(slug=tenant_slug).first()
    user = User.objects.filter(username=username).first()
    if tenant is None or user is None or not user.is_active:
        raise TokenForbidden("the token's tenant or user is not known here")
    member_role = Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()
    if member_role is None:
        raise TokenForbidden("the token's user is not a member of its tenant")
    try:  # required, and a number (jwt.decode checked it)
        expires_at = datetime.fromtimestamp(claims["exp"], UTC)
    except (OverflowError, ValueError, OSError):  # past what a datetime holds (year 9999)
        expires_at = datetime.max.replace(tzinfo=UTC)
    return Grant(user, tenant, min(role, member_role, key=lambda r: ROLE_RANK[Role(r)]), scopes, expires_at)

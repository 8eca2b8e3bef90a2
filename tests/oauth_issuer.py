"""A tiny OAuth issuer for the tests: RSA and EC keys generated here, their JWKS served over
loopback HTTP (a real server on its own thread), and tokens signed with them (PyJWT)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


class Issuer:
    """Serves GET /jwks (counting fetches); sign() makes tokens with one of its keys.

    `mode` makes its JWKS endpoint misbehave: "error" answers 500, "garbage" a JSON body that
    is no key set, "hang" holds every request without an answer until mode changes back."""

    def __init__(self) -> None:
        self.private: dict[str, tuple[Any, str]] = {}  # kid -> (private key, alg)
        self.unnamed: set[str] = set()  # kids published without their alg (RFC 7517 makes it optional)
        self.fetches = 0
        self.mode = "ok"
        self.add("rsa-1", rsa_key(), "RS256")
        self.add("ec-1", ec_key(), "ES256")
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.fetches += 1
                while issuer.mode == "hang":
                    time.sleep(0.05)
                body = json.dumps(issuer.jwks() if issuer.mode != "garbage" else [issuer.jwks()]).encode()
                self.send_response(500 if issuer.mode == "error" else 200 if self.path == "/jwks" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.jwks_uri = f"{self.url}/jwks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, kid: str, key: Any, alg: str, *, publish_alg: bool = True) -> None:
        self.private[kid] = (key, alg)
        if not publish_alg:
            self.unnamed.add(kid)

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid, (key, alg) in self.private.items():
            algorithm = RSAAlgorithm if alg.startswith(("RS", "PS")) else ECAlgorithm
            jwk = {**algorithm.to_jwk(key.public_key(), as_dict=True), "kid": kid, "use": "sig"}
            keys.append(jwk if kid in self.unnamed else {**jwk, "alg": alg})
        return {"keys": keys}

    def claims(self, audience: str, **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        return {
            "iss": self.url,
            "sub": "alice",
            "aud": audience,
            "iat": now,
            "exp": now + 300,
            "tenant": "acme",
            "scope": "runtime:read runtime:operate",
            **overrides,
        }

    def sign(self, claims: dict[str, Any], kid: str = "rsa-1", *, key: Any = None, alg: str | None = None) -> str:
        own, own_alg = self.private[kid]
        return jwt.encode(claims, key if key is not None else own, algorithm=alg or own_alg, headers={"kid": kid})

    def settings(self, audience: str) -> dict[str, Any]:
        """The runtime.yaml `oauth` section for this issuer."""
        return {
            "issuer": self.url,
            "jwks_uri": self.jwks_uri,
            "resource": audience,
            "audience": "",
            "tenant_claim": "tenant",
            "user_claim": "sub",
            "scopes": {
                "runtime:read": "read",
                "runtime:operate": "operate",
                "runtime:approve": "approve",
                "runtime:admin": "admin",
            },
            "algorithms": ["RS256", "PS256", "ES256", "EdDSA"],
            "leeway_seconds": 0,
            "jwks_cache_seconds": 300,
            "jwks_refresh_seconds": 0,
        }

    def env(self, audience: str) -> dict[str, str]:
        """The same, as the environment of a process the test starts."""
        return {
            f"OAUTH_{key.upper()}": json.dumps(value)
            if isinstance(value, dict)
            else ",".join(value)
            if isinstance(value, list)
            else str(value)
            for key, value in self.settings(audience).items()
            if value != ""
        }

    def close(self) -> None:
        self.mode = "ok"  # lets a held request go, so shutdown need not wait for it
        self.server.shutdown()
        self.server.server_close()

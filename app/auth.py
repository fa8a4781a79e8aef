"""API keys → tenant: which HTTP requests an ingress with API keys admits, and whose KV each request's turn is.

Tenants never share KV (prefix hashes are scoped by tenant), so the tenant is derived from the secret a request
carries, hashed: the secret itself is never kept beside the KV it names.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

logger = logging.getLogger(__name__)

# A file of API keys, one per line, read at start-up in addition to the config's `openai.api_keys`.
API_KEYS_FILE_ENV = "KVRELAY_API_KEYS_FILE"
# Routes anyone may call when API keys are configured.
OPEN_ROUTES = ("/health", "/version")


def hashed(secret: str) -> str:
    """A tenant key from an API key or Authorization header: tenants never share KV, and the secret is not kept."""
    return hashlib.blake2b(secret.encode(), digest_size=12).hexdigest() if secret else ""


def load_api_keys(configured: list[str]) -> list[str]:
    """The configured keys, then those in the file `KVRELAY_API_KEYS_FILE` names (blank lines skipped)."""
    keys = list(configured)
    path = os.environ.get(API_KEYS_FILE_ENV)
    if path:
        keys += [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """The API keys one ingress accepts; with none, every route is open and the tenant is the Authorization header."""

    keys: list[str]

    @classmethod
    def load(cls, configured: list[str]) -> ApiKeys:
        """The config's keys and the key file's (`load_api_keys`); warns when that leaves the ingress open."""
        keys = cls(load_api_keys(configured))
        if not keys.keys:
            logger.warning("no API keys configured: every endpoint is open to anyone who can reach it "
                           "(set openai.api_keys or %s)", API_KEYS_FILE_ENV)
        return keys

    def key(self, request: Request) -> str | None:
        """The configured API key the request carries, else None."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        key = key.strip()
        # Constant-time comparison: how long a refusal takes says nothing about how close a guess was.
        return next((k for k in self.keys if hmac.compare_digest(k.encode(), key.encode())), None)

    def admits(self, request: Request) -> bool:
        """Whether the request may reach its route: a keyless ingress and the open routes admit every request."""
        return not self.keys or request.url.path in OPEN_ROUTES or self.key(request) is not None

    def tenant(self, request: Request) -> str:
        """Whose KV a request's turn is: its API key (hashed), or without keys its Authorization header (hashed)."""
        if self.keys:
            return hashed(self.key(request) or "")
        return hashed(request.headers.get("authorization", ""))

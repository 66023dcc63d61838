"""Per-agent tokens for the Jupyter Server API on the loopback TCP port.

A token is shown once, when it is minted; the state directory keeps only its
SHA-256, so a copy of the file gives no access.  Checking compares digests
with :func:`hmac.compare_digest` (constant time) against every token of the
agent named in the URL, so alice's token is simply not among bob's.  The file
is replaced atomically (temp file, fsync, rename) and is mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time

from ..errors import not_found
from .. import state_files

TOKEN_ID_CHARS = 12


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class TokenStore:
    """Tokens by agent, in ``<state>/jupyter_tokens.json``."""

    def __init__(self, state_dir: str):
        self.path = os.path.join(state_dir, "jupyter_tokens.json")
        self._lock = threading.Lock()
        self._tokens: list[dict] = self._load()

    def _load(self) -> list[dict]:
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise RuntimeError(f"cannot read the token store {self.path}: {e}") from None
        return [t for t in saved.get("tokens", []) if isinstance(t, dict) and {"id", "agent", "sha256"} <= set(t)]

    def _save(self) -> None:
        state_files.write_json(self.path, {"tokens": self._tokens}, mode=0o600)

    def mint(self, agent: str) -> dict:
        """A new token for ``agent``: ``{"id", "token", "created"}``; the secret is not kept."""
        token = secrets.token_urlsafe(32)
        entry = {"id": secrets.token_hex(TOKEN_ID_CHARS // 2), "agent": agent, "sha256": _digest(token),
                 "created": time.time()}
        with self._lock:
            self._tokens.append(entry)
            self._save()
        return {"id": entry["id"], "token": token, "created": entry["created"]}

    def list(self, agent: str) -> list[dict]:
        return [{"id": t["id"], "created": t.get("created")} for t in self._tokens if t["agent"] == agent]

    def revoke(self, agent: str, token_id: str) -> None:
        with self._lock:
            kept = [t for t in self._tokens if not (t["agent"] == agent and t["id"] == token_id)]
            if len(kept) == len(self._tokens):
                raise not_found(f"agent {agent!r} has no token {token_id!r}", "list them: GET .../tokens",
                                code="unknown_token")
            self._tokens = kept
            self._save()

    def check(self, agent: str, token: str | None) -> bool:
        """True if ``token`` is one of ``agent``'s tokens."""
        if not token:
            return False
        given = _digest(token).encode()
        ok = False
        for entry in self._tokens:
            # Every digest of the agent is compared, in constant time each.
            if entry["agent"] == agent and hmac.compare_digest(given, entry["sha256"].encode()):
                ok = True
        return ok

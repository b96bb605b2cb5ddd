"""The job token's seal on control messages (docs/launcher.md, "The job token"): both
sides of every channel sign what they write and open what they read with it, the agents'
control plane and the worker store alike.

HMAC-SHA256 over the run id and the message, with the token as the key: a message
unsigned, or signed with another token, opens to None. Messages name what they are about
(a generation, a pid, a rank), so a signed one moved to another key is stale where it
lands; the readers check that.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

TOKEN_ENV = "CHAMELEON_JOB_TOKEN"
_SEALED = "hmac:"  # never the start of an unsigned value (JSON, a number)


class Seal:
    """Signs control messages with the job token (HMAC-SHA256 over the run id and the
    message) and opens them: a message unsigned, or signed with another token, opens to
    None and its reader acts as if it were not there. Without a token it signs nothing
    and opens everything (the job is unauthenticated, and its launcher says so).

    The first message refused calls ``on_refused`` once: enough to tell the user that
    someone writes to the job's store, without one line per forged message."""

    def __init__(
        self,
        token: str | None,
        run_id: str,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._key = token.encode() if token else None
        self._run = run_id.encode()
        self._on_refused = on_refused
        self.refused = 0

    @property
    def on(self) -> bool:
        return self._key is not None

    def _mac(self, body: bytes) -> str:
        assert self._key is not None
        return hmac.new(self._key, self._run + b"\n" + body, hashlib.sha256).hexdigest()

    def seal(self, body: str) -> str:
        if self._key is None:
            return body
        return f"{_SEALED}{self._mac(body.encode())}:{body}"

    def open(self, raw: str | bytes, where: str = "") -> str | None:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if self._key is None:
            return text
        if text.startswith(_SEALED):
            mac, _, body = text[len(_SEALED) :].partition(":")
            if hmac.compare_digest(mac, self._mac(body.encode())):
                return body
        self.refused += 1
        if self.refused == 1 and self._on_refused is not None:
            self._on_refused(where)
        return None

    def proof(self) -> str:
        """What a job's first agent writes for joiners to check their token against."""
        return self.seal("chameleon job")

    def refusal(self, proof: str | bytes | None) -> str | None:
        """Why an agent with this seal may not join a job whose proof is ``proof``."""
        text = proof.decode() if isinstance(proof, bytes) else (proof or "")
        signed = text.startswith(_SEALED)
        if self._key is None:
            return (
                "needs its job token (--rdzv-conf token=... or CHAMELEON_JOB_TOKEN)"
                if signed
                else None
            )
        if not signed:
            return "runs without a job token, and this agent has one"
        if not hmac.compare_digest(text, self.proof()):
            return "is signed with another job token"
        return None

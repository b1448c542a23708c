"""What a seal looks like on the wire, with nothing of the engine: the message-id header, the digest's form, and the
daemon-only record types (`recovery.core.firings` holds the rules; `recovery.core.overruns` reads the facts a replay
needs first, and may not import the rules: they import the record, which imports it)."""

from __future__ import annotations

import re

__all__ = ["DIGEST_CHARS", "FORGED_FIRING_CODES", "MSG_ID", "SEALED_FACTS", "sealed_form"]

MSG_ID = "Nats-Msg-Id"
DIGEST_CHARS = 24
"""hex characters of the HMAC a sealed message id ends with (`<id>~<digest>`): 96 bits no publisher guesses"""
_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_CHARS}}}")

SEALED_FACTS = {"control.outage": "outage", "node.silent": "silence", "node.heard": "heard",
                "node.unreachable": "unreachable", "policy.overran": "overrun"}
"""the daemon's own facts beside its timer firings (its outages, its liveness monitor's word on a node, a
third-party policy's call it abandoned), by type: each sealed as a firing is, and its dead letters coded
`<code>_unsealed`, `<code>_forged`"""
FORGED_FIRING_CODES = ("timer_early", "timer_unsealed", "timer_forged",
                       *(f"{code}_{how}" for code in SEALED_FACTS.values() for how in ("unsealed", "forged")))
"""the dead-letter codes of firings (and of the daemon's other facts, `SEALED_FACTS`) that are not real:
`recovery-replay verify` reports every one"""


def sealed_form(msg_id: str | None, ident: str) -> bool:
    """Whether `msg_id` is `ident` followed by a seal's digest (whether the digest is right needs the secret)."""
    return (msg_id is not None and len(msg_id) == len(ident) + 1 + DIGEST_CHARS and msg_id.startswith(ident)
            and msg_id[len(ident)] == "~" and _DIGEST.fullmatch(msg_id, len(ident) + 1) is not None)

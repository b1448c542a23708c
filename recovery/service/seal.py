"""Message ids that only the daemon can make, for what it writes into the log beside its inputs.

Decisions, dead letters and timer firings share the log stream, and so its duplicate window, with the inputs any
publisher sends; their ids are deterministic (`dec:<job>:<seq>:<i>`, `rej:<seq>`, `timer:<id>:<due>`), so that a
restarted daemon publishing them again is deduplicated. Deterministic ids are also predictable: a publisher of
inputs could store a message under a future decision's id first, and the real one would be dropped as its
duplicate. The `Nats-Msg-Id` of each of these is therefore the id followed by an HMAC of it under a secret kept in
the daemon's KV bucket: still the same on every republish by any daemon of the deployment, never guessable by a
publisher. The envelope's own id is unchanged, so logs, replays and reports are not.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from recovery.core.seals import DIGEST_CHARS  # the engine checks a firing's seal by its form too

SEAL_KEY = "_seal.secret"
"""the secret's key in the snapshot bucket (a partition's keys are `<partition>` and `<partition>.<slot>.<n>`)"""


class Seal:
    """`seal(id)`: the message id under which the daemon publishes the output or timer firing `id`."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def __call__(self, ident: str) -> str:
        digest = hmac.new(self._secret, ident.encode(), hashlib.sha256).hexdigest()[:DIGEST_CHARS]
        return f"{ident}~{digest}"


async def load_seal(js: JetStreamContext, bucket: str) -> Seal:
    """The deployment's seal: its secret read from `bucket`, or made and stored there by the first daemon (a
    create, so that two daemons starting at once agree on one)."""
    kv = await js.key_value(bucket)
    # Another daemon made it first: use that one. nats-py's create reads the key back after a refusal, and a replica
    # not caught up (a server restarting under a replicated bucket) may not have it yet: the read below says so.
    with contextlib.suppress(KeyWrongLastSequenceError, KeyNotFoundError):
        await kv.create(SEAL_KEY, os.urandom(32))
    try:
        entry = await kv.get(SEAL_KEY)
    except KeyNotFoundError:
        raise TimeoutError("the seal is not readable yet: a replica catching up") from None  # tried again
    assert entry.value is not None
    return Seal(bytes(entry.value))

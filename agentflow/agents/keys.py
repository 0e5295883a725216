"""Per-episode API keys for black-box agents.

A key is `ep-<episode id hex>-<HMAC>`: the gateway can check it and learn the episode it
is bound to without a database row, and one agent's key never opens another episode.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

from agentflow.errors import Unauthorized

_PREFIX = "ep-"


def _mac(episode_id: uuid.UUID, secret: str) -> str:
    return hmac.new(secret.encode(), episode_id.bytes, hashlib.sha256).hexdigest()[:40]


def episode_key(episode_id: uuid.UUID, secret: str) -> str:
    """The key an agent sends as `Authorization: Bearer <key>` for this episode."""
    return f"{_PREFIX}{episode_id.hex}-{_mac(episode_id, secret)}"


def episode_for_key(key: str, secret: str) -> uuid.UUID:
    """The episode a key is bound to; `Unauthorized` for a malformed or forged key."""
    if not key.startswith(_PREFIX):
        raise Unauthorized("not an episode key")
    body, _, mac = key[len(_PREFIX) :].partition("-")
    try:
        episode_id = uuid.UUID(hex=body)
    except ValueError:
        raise Unauthorized("malformed episode key") from None
    # Bytes: compare_digest refuses str with non-ASCII characters, which a header may hold.
    if not hmac.compare_digest(
        mac.encode("utf-8", "surrogateescape"), _mac(episode_id, secret).encode()
    ):
        raise Unauthorized("wrong episode key")
    return episode_id

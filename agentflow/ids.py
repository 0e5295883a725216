"""Fresh random ids for what a run makes thousands of a second (turns, episodes,
trajectories, engine requests).

`new_id()` is a version-4 UUID like `uuid.uuid4()`, from the same source (`os.urandom`),
made cheaper where a controller makes several per turn:

- the random bytes come 256 ids at a time, one system call instead of one per id;
- each is asyncpg's `UUID` (C, a subclass of `uuid.UUID`): made from its bytes in about
  a tenth of the time, hashed once and cached (a turn's id is hashed about a dozen
  times on its way to the database), compared in C, and sent to PostgreSQL as its
  bytes. It equals, hashes and orders like the `uuid.UUID` of the same value, and
  pickles and serializes the same way.

A forked child starts with no ids left over from its parent, so two processes never
hand out the same ones.
"""

from __future__ import annotations

import os
import uuid

from asyncpg.pgproto.pgproto import UUID as _FastUUID

_BATCH = 256  # ids per system call
# RFC 4122 version 4: the version in the high nibble of byte 6, the variant in the top
# two bits of byte 8 (what `uuid.UUID(bytes=..., version=4)` sets), as byte maps.
_VERSION = bytes(b & 0x0F | 0x40 for b in range(256))
_VARIANT = bytes(b & 0x3F | 0x80 for b in range(256))
_pending: list[uuid.UUID] = []


def _refill() -> None:
    raw = bytearray(os.urandom(16 * _BATCH))
    raw[6::16] = raw[6::16].translate(_VERSION)
    raw[8::16] = raw[8::16].translate(_VARIANT)
    data = bytes(raw)
    _pending.extend([_FastUUID(data[i : i + 16]) for i in range(0, len(data), 16)])


def new_id() -> uuid.UUID:
    """A new random (version 4) UUID."""
    if not _pending:
        _refill()
    return _pending.pop()


def new_hex() -> str:
    """A new random id as 32 hex digits (`uuid.uuid4().hex`'s form)."""
    return new_id().hex


os.register_at_fork(after_in_child=_pending.clear)

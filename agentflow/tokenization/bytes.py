"""The project's own byte-level tokenizer: 256 byte ids followed by a few special tokens.

Small models built from a `ModelInit` use it, so no vocabulary file is needed and every
string round-trips exactly (UTF-8 bytes). Special tokens mark the sequence (BOS/EOS/PAD),
role boundaries of a chat, the end of a message, and tool calls; they never come out of
`encode` for ordinary text, so user or env text cannot forge a role boundary.
"""

from __future__ import annotations

import array
import codecs
import re
import sys
from collections.abc import Sequence

from agentflow.errors import InvalidInput

# Order fixes the ids (256 + index): never reorder, saved models depend on it.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|tool_call|>",
    "<|/tool_call|>",
)
# array("I") items (4 bytes on every platform CPython supports) read as UTF-32. The codec
# function itself: looking the codec up by name costs more than decoding short ids.
_utf32_decode = codecs.utf_32_le_decode if sys.byteorder == "little" else codecs.utf_32_be_decode
# With specials among them, up to this many ids decode faster one by one than in
# `_decode_runs`'s few C passes, which cost a few microseconds however short the ids.
_LOOP_UP_TO = 32
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus `SPECIAL_TOKENS` (ids 256+)."""

    byte_count = 256

    def __init__(self) -> None:
        self._special = {tok: self.byte_count + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self._special.items()}
        # `decode` turns ids into one character each (chr(id)): special ids are then the
        # characters just past the bytes, and a run of byte ids between them is latin-1.
        first, last = chr(self.byte_count), chr(self.vocab_size - 1)
        self._split_at_specials = re.compile(f"([{first}-{last}])")

    @property
    def vocab_size(self) -> int:
        return self.byte_count + len(SPECIAL_TOKENS)

    @property
    def pad_id(self) -> int:
        return self._special["<|pad|>"]

    @property
    def bos_id(self) -> int:
        return self._special["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self._special["<|eos|>"]

    @property
    def end_id(self) -> int:
        """End of one chat message: the assistant's turn stops on it."""
        return self._special["<|end|>"]

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special_by_id)

    def token_id(self, token: str) -> int | None:
        return self._special.get(token)

    def role_id(self, role: str) -> int:
        tid = self._special.get(f"<|{role}|>")
        if tid is None or role not in ("system", "user", "assistant", "tool"):
            raise InvalidInput(f"unknown chat role {role!r}", field="role")
        return tid

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(self._special[m.group()])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        if isinstance(ids, list | tuple):  # bytes() would copy an array's buffer instead
            try:
                # Byte ids only, the usual case: bytes() refuses ids past 255, below 0 or
                # not integers, and the ids below say which.
                return bytes(ids).decode("utf-8", errors="replace")
            except (TypeError, ValueError):
                pass
            if len(ids) > _LOOP_UP_TO:
                try:
                    return self._decode_runs(ids, skip_special)
                except (TypeError, ValueError, OverflowError):  # UnicodeError is a ValueError
                    pass  # not ids of this vocabulary: the loop below names the first
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < self.byte_count:
                buf.append(i)
                continue
            tok = self._special_by_id.get(i)
            if tok is None:
                raise InvalidInput(f"id {i} is outside the byte vocabulary", field="ids")
            # Flush pending bytes first so a multi-byte character split by nothing decodes whole.
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special:
                out.append(tok)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def _decode_runs(self, ids: list[int] | tuple[int, ...], skip_special: bool) -> str:
        """`decode` in a few C passes; raises TypeError or ValueError (OverflowError) for ids
        outside the vocabulary."""
        # One character per id (chr(id)): the uint32s read as UTF-32.
        chars = _utf32_decode(array.array("I", ids).tobytes(), "strict", True)[0]
        out: list[str] = []
        # The specials land at odd places; each byte run between them decodes on its own,
        # so a multi-byte character cut by a special becomes replacement characters. A run
        # holding an id past the vocabulary fails its latin-1 encoding.
        for k, part in enumerate(self._split_at_specials.split(chars)):
            if k % 2 == 0:
                out.append(part.encode("latin-1").decode("utf-8", errors="replace"))
            elif not skip_special:
                out.append(self._special_by_id[ord(part)])
        return "".join(out)

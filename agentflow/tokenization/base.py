"""The `Tokenizer` protocol every model-facing part uses, and its special-token ids.

Token ids are the currency of the system: trajectories store exactly the ids the engine
saw and produced, and nothing is re-tokenized from text. A tokenizer therefore exposes
its special ids (BOS/EOS/PAD, the end-of-turn token the assistant stops on) so that the
chat template and the engine can work on ids alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover."""
        ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`; special-token markers in it are literal text unless allowed."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str: ...

    def token_id(self, token: str) -> int | None:
        """The id of a single special token written as text (e.g. `<|end|>`), if any."""
        ...

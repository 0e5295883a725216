"""A real checkpoint's tokenizer, loaded from its local directory through transformers.

transformers is imported only here, and only when a tokenizer is loaded: the gateway and
the byte-level path never pay for it. Nothing is downloaded (`local_files_only`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentflow.errors import InvalidInput

# End-of-turn tokens of common chat formats (ChatML, Llama 3 incl. its after-a-tool-call
# `<|eom_id|>`, Gemma, Phi).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


class HFTokenizer:
    """Adapts a transformers tokenizer to the project's `Tokenizer` protocol."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        if hf.eos_token_id is None:
            raise InvalidInput("the tokenizer defines no EOS token", field="tokenizer")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def token_id(self, token: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(token)
        unk = self.hf.unk_token_id
        if tid is None or (unk is not None and tid == unk and token != self.hf.unk_token):
            return None
        return int(tid)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """EOS plus whichever known end-of-turn tokens this vocabulary has."""
        ids = [self.eos_id]
        for tok in END_OF_TURN_TOKENS:
            tid = self.token_id(tok)
            if tid is not None and tid not in ids:
                ids.append(tid)
        return tuple(ids)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        # split_special_tokens: user or env text that contains "<|im_end|>" stays plain text.
        return list(
            self.hf.encode(text, add_special_tokens=False, split_special_tokens=not allow_special)
        )

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    p = Path(path)
    if not p.is_dir():
        raise InvalidInput(f"no tokenizer directory at {p}", field="path")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InvalidInput(f"cannot load a tokenizer from {p}: {e}", field="path") from e
    return HFTokenizer(hf)

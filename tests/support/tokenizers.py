"""A tiny byte-level BPE tokenizer saved in Hugging Face's format, for tests of the code
that loads real tokenizers (chat templates, matching, placeholders) without a download."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def save_bpe_tokenizer(
    path: Path,
    corpus: str,
    chat_template: str,
    *,
    vocab_size: int = 300,
    extra_specials: Sequence[str] = (),
    repeat: int = 10,
) -> Path:
    """Train a BPE of `vocab_size` on `corpus` and save it (ChatML specials, plus
    `extra_specials`) with `chat_template` to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*BASE_SPECIALS, *extra_specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus] * repeat, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path

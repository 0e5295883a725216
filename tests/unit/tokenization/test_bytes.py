from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentflow.errors import InvalidInput
from agentflow.tokenization import SPECIAL_TOKENS, ByteTokenizer, Tokenizer, load_tokenizer


def test_vocab_layout():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert tok.token_id("<|end|>") == tok.end_id
    assert tok.token_id("<|nope|>") is None
    assert load_tokenizer("bytes").vocab_size == tok.vocab_size


@given(st.text())
def test_text_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_special_markers_are_text_unless_allowed():
    tok = ByteTokenizer()
    text = "a<|end|>b"
    assert tok.end_id not in tok.encode(text)
    ids = tok.encode(text, allow_special=True)
    assert ids == [ord("a"), tok.end_id, ord("b")]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "ab"


def test_multibyte_characters_split_by_special_tokens():
    tok = ByteTokenizer()
    ids = tok.encode("é") + [tok.eos_id] + tok.encode("ü")
    assert tok.decode(ids) == "é<|eos|>ü"


def test_decode_rejects_ids_outside_vocab():
    with pytest.raises(InvalidInput):
        ByteTokenizer().decode([1000])


def test_role_ids():
    tok = ByteTokenizer()
    assert tok.role_id("user") == tok.token_id("<|user|>")
    with pytest.raises(InvalidInput):
        tok.role_id("end")


def test_import_does_not_load_torch_or_transformers():
    code = (
        "import sys, agentflow.tokenization as t; t.ByteChatTemplate().render("
        "[{'role': 'user', 'content': 'x'}]); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]

from __future__ import annotations

import array
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


@pytest.mark.parametrize("pad", [0, 40])  # short ids decode one by one, long ones in runs
def test_decode_splits_at_specials_and_replaces_cut_characters(pad):
    tok = ByteTokenizer()
    head = tok.encode("x" * pad)
    e_acute = tok.encode("é")
    call = tok.token_id("<|tool_call|>")
    assert call is not None
    ids = [*head, e_acute[0], call, e_acute[1], *tok.encode("ok€")]
    ids += [tok.end_id]
    assert tok.decode(ids) == "x" * pad + "\ufffd<|tool_call|>\ufffdok€<|end|>"
    assert tok.decode(tuple(ids), skip_special=True) == "x" * pad + "\ufffd\ufffdok€"


@pytest.mark.parametrize("pad", [0, 40])
@pytest.mark.parametrize("bad", [-1, 266, 1000, 0xD800, 2**40])
def test_decode_names_the_first_id_outside_the_vocab(pad, bad):
    tok = ByteTokenizer()
    ids = [*tok.encode("y" * pad), tok.eos_id, bad, 5000]
    with pytest.raises(InvalidInput, match=f"id {bad} is outside the byte vocabulary"):
        tok.decode(ids)


def test_decode_takes_any_sequence_of_ids():
    tok = ByteTokenizer()
    assert tok.decode(array.array("q", [104, 105])) == "hi"  # its items, not its buffer
    assert tok.decode(range(104, 106)) == "hi"
    assert tok.decode([104, True]) == "h\x01"
    assert tok.decode([]) == ""

"""The byte tokenizer saved as HF files loads with `AutoTokenizer` and tokenizes and
renders chats exactly as the project's own classes do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentflow.tokenization.bytes import SPECIAL_TOKENS, ByteTokenizer
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.tokenization.hf_export import save_byte_tokenizer

transformers = pytest.importorskip("transformers")

BYTES = ByteTokenizer()
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "answer", "description": "Say it."}},
]
CALL = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    save_byte_tokenizer(directory)
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from([f"a{s}b" for s in SPECIAL_TOKENS]))
def test_ids_and_text_match_the_byte_tokenizer(exported: Any, text: str) -> None:
    ids = BYTES.encode(text, allow_special=True)
    assert exported.encode(text, add_special_tokens=False) == ids
    assert exported.decode(ids) == text


def test_special_tokens_keep_their_ids(exported: Any) -> None:
    assert exported.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [
        BYTES.token_id(s) for s in SPECIAL_TOKENS
    ]
    assert (exported.bos_token_id, exported.eos_token_id, exported.pad_token_id) == (
        BYTES.bos_id,
        BYTES.eos_id,
        BYTES.pad_id,
    )


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("system", [None, "", "Be brief."])
def test_the_chat_template_renders_what_the_project_renders(
    exported: Any, tools: Any, system: str | None
) -> None:
    messages: list[dict[str, Any]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    messages += [
        {"role": "user", "content": "héllo wörld"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c", "content": "rex"},
    ]
    for generation in (True, False):
        ids = exported.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=True
        )["input_ids"]
        want = ByteChatTemplate().render(messages, tools=tools, add_generation_prompt=generation)
        assert list(ids) == want.token_ids

"""Matching with an HF (ChatML, Hermes tool calls) chat template, as Qwen models use."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentflow.agents.blackbox.matching import assistant_view, match_request
from agentflow.tokenization import HFChatTemplate, chat_template_for, load_tokenizer
from tests.support.tokenizers import save_bpe_tokenizer
from tests.unit.agents.blackbox.test_matching import node

CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    '{%- for c in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> HFChatTemplate:
    path: Path = tmp_path_factory.mktemp("tok")
    save_bpe_tokenizer(path, "user assistant tool_call lookup arguments name", CHATML)
    tpl = chat_template_for(load_tokenizer(path))
    assert isinstance(tpl, HFChatTemplate)
    return tpl


FIRST = [{"role": "user", "content": "ann's pet?"}]
TOOL = {"role": "tool", "tool_call_id": "c", "content": "owl"}


def test_echo_and_own_assistant_messages_match_with_an_hf_template(template) -> None:
    tok = template.tokenizer
    text = 'ok\n<tool_call>\n{"name": "lookup", "arguments": {"key": "ann.pet"}}\n</tool_call>'
    output = [*tok.encode(text, allow_special=True), *template.stop_ids[-1:]]
    view = assistant_view(template, output)
    assert [c.name for c in view.tool_calls] == ["lookup"] and view.content == "ok"
    echo = {
        "role": "assistant",
        "content": view.content,
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"key": "ann.pet"}'},
            }
        ],
    }
    # First turn: the agent's own assistant message (not a sample) after the policy turn.
    own = {"role": "assistant", "content": "checking"}
    policy = node("policy", output)
    prompt = node("prompt", template.render(FIRST).token_ids, policy)
    first = match_request(template, [prompt], [*FIRST, echo, own, TOOL])
    assert [t.id for t in first.path] == [prompt.id, policy.id]
    env = node("env", first.new_tokens)
    policy = node("policy", output, env)
    prompt = node("prompt", prompt.token_ids, policy)
    # Sent again: the segment spanning the agent's own message is followed as recorded.
    again = match_request(template, [prompt], [*FIRST, echo, own, TOOL])
    assert [t.id for t in again.path] == [prompt.id, policy.id, env.id]
    assert again.new_tokens == []

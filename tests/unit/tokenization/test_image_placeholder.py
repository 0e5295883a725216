"""Each template's image placeholder: what a vision engine expands into the image."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentflow.tokenization import HFChatTemplate, chat_template_for, load_tokenizer
from agentflow.tokenization.chat import ByteChatTemplate
from tests.support.tokenizers import save_bpe_tokenizer

CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def hf_template(path: Path, extra: list[str]) -> HFChatTemplate:
    save_bpe_tokenizer(path, "user assistant look at this", CHATML, extra_specials=extra)
    template = chat_template_for(load_tokenizer(path))
    assert isinstance(template, HFChatTemplate)
    return template


def test_byte_template_placeholder_is_plain_text() -> None:
    template = ByteChatTemplate()
    ids = template.render([{"role": "user", "content": template.image_placeholder}]).token_ids
    assert template.tokenizer.decode(ids).count("<|image|>") == 1
    assert all(i < 256 for i in template.tokenizer.encode(template.image_placeholder))


@pytest.mark.parametrize(
    ("specials", "placeholder"),
    [
        (
            ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
            "<|vision_start|><|image_pad|><|vision_end|>",
        ),
        (["<image>"], "<image>"),
        ([], "<image>"),
    ],
)
def test_hf_placeholder_follows_the_vocabulary(
    tmp_path: Path, specials: list[str], placeholder: str
) -> None:
    template = hf_template(tmp_path, specials)
    assert template.image_placeholder == placeholder
    rendered = template.render([{"role": "user", "content": f"look {placeholder}"}]).token_ids
    for token in specials:  # the vision tokens are single special ids in the prompt
        assert rendered.count(template.tokenizer.token_id(token)) == 1

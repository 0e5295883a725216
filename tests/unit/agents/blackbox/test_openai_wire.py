"""Chat requests validated, answers and SSE chunks shaped as OpenAI clients parse them."""

from __future__ import annotations

import json
import uuid

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentflow.agents.blackbox.live import LiveEpisodes, TooManyRequests
from agentflow.agents.blackbox.matching import assistant_view
from agentflow.agents.blackbox.openai_schema import parse_request
from agentflow.agents.blackbox.proxy import ChatAnswer
from agentflow.agents.blackbox.responses import completion_of
from agentflow.agents.blackbox.sse import ChunkWriter, ContentStream
from agentflow.errors import InvalidInput
from agentflow.inference.base import GenerateResult, VersionSpan
from agentflow.tokenization.chat import ByteChatTemplate

TEMPLATE = ByteChatTemplate()
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"messages": [USER]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [USER], "n": 2}, "n"),
        ({"model": "m", "messages": [USER], "stop": [""]}, "stop"),
        ({"model": "m", "messages": [USER], "stop": ["x"] * 17}, "stop"),
        ({"model": "m", "messages": [USER], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "model": "m",
                "messages": [USER],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tool_choice",
        ),
        ({"model": "m", "messages": [USER], "tool_choice": "always"}, "tool_choice"),
        (
            {"model": "m", "messages": [USER], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"model": "m", "messages": [USER], "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"model": "m", "messages": [USER], "presence_penalty": -1}, "presence_penalty"),
        ({"model": "m", "messages": [USER], "logit_bias": {"5": 10}}, "logit_bias"),
        ({"model": "m", "messages": [USER], "top_logprobs": 3}, "top_logprobs"),
        ({"model": "m", "messages": [USER], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"model": "m", "messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [USER, {"role": "assistant", "content": "x"}]}, "messages"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{"}}],
                    },
                    USER,
                ],
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_malformed_requests_name_the_field(body: object, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_request(body)
    assert ".".join(err.value.field).startswith(field)


def test_request_normalises_for_the_template() -> None:
    request = parse_request(
        {
            "model": "gpt-4o",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                USER,
            ],
            "max_tokens": 50,
            "max_completion_tokens": 20,
            "user": "ignored",
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "frequency_penalty": 0,
            "stop": "Observation:",
        }
    )
    assert request.template_messages()[0] == {"role": "system", "content": "ab"}
    assert request.token_limit() == 20 and not request.parse_tool_calls
    assert request.stop_strings() == ("Observation:",)


def answer(text: str, finish: str = "stop") -> ChatAnswer:
    ids = [*TEMPLATE.tokenizer.encode(text, allow_special=True), TEMPLATE.tokenizer.end_id]
    result = GenerateResult(
        rid="r",
        output_ids=ids,
        logprobs=[-0.5] * len(ids),
        finish_reason=finish,  # type: ignore[arg-type]
        weight_versions=[VersionSpan(version=3, start=0, end=len(ids))],
        prompt_tokens=10,
        cached_tokens=4,
    )
    return ChatAnswer(
        episode_id=uuid.uuid4(),
        turn_id=uuid.uuid4(),
        parent_id=uuid.uuid4(),
        model="tiny",
        template=TEMPLATE,
        result=result,
        view=assistant_view(TEMPLATE, ids),
        created=1,
    )


CALL = 'ok <|tool_call|>{"name": "lookup", "arguments": {"key": "a.b"}}<|/tool_call|>'


def test_completion_parses_as_an_openai_object() -> None:
    a = answer(CALL)
    body = completion_of(a, with_logprobs=True)
    parsed = ChatCompletion.model_validate(body)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "a.b"}
    assert call.id.startswith("call_" + a.turn_id.hex[:24])
    assert parsed.usage is not None and parsed.usage.prompt_tokens == 10
    assert parsed.usage.completion_tokens == len(a.result.output_ids)
    assert [t.logprob for t in choice.logprobs.content] == a.result.logprobs  # type: ignore[union-attr]


def stream_events(a: ChatAnswer, stops: tuple[str, ...] = ()) -> list[str]:
    """The SSE events of `a` when its tokens arrive one at a time."""
    writer = ChunkWriter("chatcmpl-x", a.model, a.created, with_logprobs=True)
    content = ContentStream(TEMPLATE, stops)
    out = [writer.chunk({"role": "assistant", "content": ""})]
    for token in a.result.output_ids:
        delta = content.feed([token])
        if delta:
            out.append(writer.chunk({"content": delta}))
    out += writer.finish(a, content, 0, include_usage=True)
    return b"".join(out).decode().split("\n\n")


def test_stream_reassembles_to_the_same_message() -> None:
    a = answer("x" * 40 + CALL)
    events = stream_events(a)
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-2]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    args = "".join(
        (tc.function.arguments or "")
        for c in chunks
        if c.choices
        for tc in (c.choices[0].delta.tool_calls or [])
    )
    message = completion_of(a)["choices"][0]["message"]
    assert content == message["content"]
    assert args == message["tool_calls"][0]["function"]["arguments"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and finishes.count(None) == len(finishes) - 1
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens == 10 + len(a.result.output_ids)


def test_length_finish_and_plain_text() -> None:
    a = answer("hello", finish="length")
    body = completion_of(a)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}


def test_flood_cap_is_per_episode() -> None:
    live = LiveEpisodes(max_in_flight=2)
    busy, other = uuid.uuid4(), uuid.uuid4()
    with live.admit(busy), live.admit(busy):
        with pytest.raises(TooManyRequests) as err:
            with live.admit(busy):
                pass
        assert err.value.status_code == 429
        with live.admit(other):
            pass
    with live.admit(busy):  # slots are given back when requests end, even on errors
        pass
    assert live.chat(busy).in_flight == 0


def test_streamed_content_never_takes_back_what_it_sent() -> None:
    """Text that could still turn into a tool-call marker or a stop string, or be
    stripped, is held back: each delta is final."""
    text = "  Thought: look <|tool_c"
    content = ContentStream(TEMPLATE, stops=("Observation:",))
    sent = [content.feed(TEMPLATE.tokenizer.encode(ch)) for ch in text]
    assert "".join(sent) == "Thought: look"  # no leading blanks, no half marker
    assert content.feed(TEMPLATE.tokenizer.encode("all|>")) == ""  # a call began: done
    stop = ContentStream(TEMPLATE, stops=("Observation:",))
    streamed = "".join(stop.feed(TEMPLATE.tokenizer.encode(ch)) for ch in "go\nObserv")
    assert streamed == "go"  # "\nObserv" may still be the stop string's start
    assert stop.feed(TEMPLATE.tokenizer.encode("ation: 3")) == "" and stop.closed


def test_streamed_logprobs_cover_every_token_once() -> None:
    a = answer("hello there")
    events = stream_events(a)
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-2]]
    entries = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert entries == a.result.logprobs

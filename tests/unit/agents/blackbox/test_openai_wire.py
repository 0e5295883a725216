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
from agentflow.agents.blackbox.sse import stream_chunks
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
        ({"model": "m", "messages": [USER], "stop": ["\n"]}, "stop"),
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
        }
    )
    assert request.template_messages()[0] == {"role": "system", "content": "ab"}
    assert request.token_limit() == 20 and not request.parse_tool_calls


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


def test_stream_reassembles_to_the_same_message() -> None:
    a = answer("x" * 40 + CALL)
    events = b"".join(stream_chunks(a, include_usage=True)).decode().split("\n\n")
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

"""The official `openai` client's fields against a real gateway: each one is honoured
with exact recording (stop strings, real streaming with log-probs, top log-probs, a
model by id) or refused with a 400 that names it, nothing recorded."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from agentflow.agents.blackbox.matching import STOP_STRING
from agentflow.tokenization.bytes import ByteTokenizer
from tests.integration.agents.blackbox.test_openai_client import SYSTEM, client_for, turn_of

pytestmark = pytest.mark.integration

QUESTION = [SYSTEM, {"role": "user", "content": "which pet?"}]


def stop_in(content: str) -> str:
    """A two-character stop string from the middle of `content` (printable, no blanks)."""
    for i in range(2, len(content) - 2):
        piece = content[i : i + 2]
        if piece.isprintable() and not piece.isspace() and piece.strip() == piece:
            return piece
    raise AssertionError(f"no usable stop string in {content!r}")


async def test_a_stop_string_ends_the_answer_and_the_tokens_stay_exact(
    gateway: Any, run_id: uuid.UUID, engine: Any
) -> None:
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        free = await client.chat.completions.create(model="m", messages=QUESTION)
    content = free.choices[0].message.content or ""
    stop = stop_in(content)

    episode = gateway.new_episode(run_id)
    async with client_for(gateway, episode) as client:
        cut = await client.chat.completions.create(
            model="m", messages=QUESTION, stop=[stop, "never-seen"], logprobs=True
        )
        answer = cut.choices[0]
        assert answer.message.content == content[: content.find(stop)].strip()
        assert answer.finish_reason == "stop"
        turn_id = turn_of(cut)
        stored = gateway.call(gateway.turns.turn(turn_id))
        # Recorded: the sampled tokens up to the one that completed the stop string, with
        # the engine's log-probs; the agent got the text before it.
        assert stored.finish_reason == STOP_STRING and stored.text == answer.message.content
        made = engine.results[turn_id.hex].output_ids
        assert list(stored.token_ids) == made[: len(stored.token_ids)]
        decode = ByteTokenizer().decode
        assert stop in decode(stored.token_ids) and stop not in decode(stored.token_ids[:-1])
        assert list(stored.logprobs) == pytest.approx([t.logprob for t in answer.logprobs.content])

        # The text echoed back continues the same turn; the engine resumes its session at
        # the recorded tokens, not at what it sampled after the stop string.
        follow = [*QUESTION, {"role": "assistant", "content": answer.message.content}]
        follow.append({"role": "user", "content": "and then?"})
        nxt = await client.chat.completions.create(model="m", messages=follow)
    path = gateway.call(gateway.turns.path(turn_of(nxt)))
    assert [t.kind for t in path] == ["prompt", "policy", "env", "policy"]
    assert path[1].id == turn_id
    context = gateway.call(gateway.turns.context(turn_of(nxt)))
    assert engine.seen(turn_of(nxt).hex) == list(context.token_ids)


async def test_streaming_sends_tokens_as_they_are_made(
    gateway: Any, run_id: uuid.UUID, engine: Any
) -> None:
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        plain = await client.chat.completions.create(model="m", messages=QUESTION)
    episode = gateway.new_episode(run_id)
    async with client_for(gateway, episode) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=QUESTION,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content  # greedy: the same answer
    with_logprobs = [c for c in chunks if c.choices and c.choices[0].logprobs]
    # The engine decodes in bursts of at most 8 tokens, so a 24-token answer reaches the
    # client in several pieces only if it streams as it is made.
    assert len(with_logprobs) >= 2
    streamed = [t.logprob for c in with_logprobs for t in c.choices[0].logprobs.content]
    turn_id = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
    stored = gateway.call(gateway.turns.turn(turn_id))
    assert streamed == pytest.approx(list(stored.logprobs))
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(stored.token_ids)


async def test_a_streamed_stop_string_matches_the_plain_answer(
    gateway: Any, run_id: uuid.UUID
) -> None:
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        free = await client.chat.completions.create(model="m", messages=QUESTION)
    stop = stop_in(free.choices[0].message.content or "")
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        plain = await client.chat.completions.create(model="m", messages=QUESTION, stop=stop)
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        stream = await client.chat.completions.create(
            model="m", messages=QUESTION, stop=stop, stream=True, logprobs=True
        )
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content
    turn_id = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
    stored = gateway.call(gateway.turns.turn(turn_id))
    streamed = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert streamed == pytest.approx(list(stored.logprobs))  # none past the stop string


async def test_top_logprobs_come_from_the_engine(gateway: Any, run_id: uuid.UUID) -> None:
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        answer = await client.chat.completions.create(
            model="m", messages=QUESTION, logprobs=True, top_logprobs=3
        )
    for token in answer.choices[0].logprobs.content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # Greedy sampling: the chosen token is the most likely one.
        assert token.top_logprobs[0].token == token.token
        assert token.logprob == pytest.approx(tops[0])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.3}, "frequency_penalty"),
        ({"logit_bias": {"65": 5}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_fields_that_would_change_sampling_are_refused_by_name(
    gateway: Any, run_id: uuid.UUID, extra: dict[str, Any], param: str
) -> None:
    episode = gateway.new_episode(run_id)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    async with client_for(gateway, episode) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=QUESTION, tools=tools, **extra)
    assert err.value.param == param
    assert param in err.value.message
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()  # nothing recorded


async def test_a_model_is_found_by_its_id(gateway: Any, run_id: uuid.UUID) -> None:
    async with client_for(gateway, gateway.new_episode(run_id)) as client:
        found = await client.models.retrieve("tiny-policy")
        assert found.id == "tiny-policy" and found.object == "model"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-nothing")


def _sample(scrape: str, name: str) -> float:
    lines = [line for line in scrape.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


async def test_black_box_requests_show_in_prometheus(gateway: Any, run_id: uuid.UUID) -> None:
    ok = 'agentflow_chat_requests_total{api="chat",outcome="ok"}'
    refused = 'agentflow_chat_requests_total{api="chat",outcome="400"}'
    policy = 'agentflow_turns_total{kind="policy"}'
    async with httpx.AsyncClient() as http:
        before = (await http.get(f"{gateway.url}/metrics")).text
        async with client_for(gateway, gateway.new_episode(run_id)) as client:
            await client.chat.completions.create(model="m", messages=QUESTION)
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    model="m", messages=QUESTION, tool_choice="required"
                )
        after = (await http.get(f"{gateway.url}/metrics")).text
    assert _sample(after, ok) == _sample(before, ok) + 1
    assert _sample(after, refused) == _sample(before, refused) + 1
    assert _sample(after, policy) == _sample(before, policy) + 1
    assert "agentflow_generate_seconds_count" in after

"""`VLLMEngine` against a real vLLM server: the tokens and log-probs recorded are the
server's own (and the trainer's to float precision), sessions reuse its prefix cache,
weight updates under `keep` and `abort` split an answer's version spans, and a version
that does not fit is refused while the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import EngineRequestError
from agentflow.inference.base import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.modeling import load_model, score
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.inference.vllm.conftest import Served, client_of

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TEMPLATE = ByteChatTemplate()
LONG = 1000  # tokens: the answers an update or an abort lands in
PACE = 0.05  # s per decoding step while an abort or a publish must land mid-answer
T = TypeVar("T")


async def generated_tokens(client: httpx.AsyncClient, url: str) -> float:
    """The server's own count of tokens it generated, from its Prometheus counter."""
    text = (await client.get(f"{url}/metrics", timeout=60)).text
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("the server reports no vllm:generation_tokens_total")


async def started(url: str, answering: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start an answer and return once the server has decoded a token of it (its counter
    of generated tokens moved). Under `Served.paced` the rest of the answer takes
    `LONG * PACE` seconds, time enough for the caller's abort or publish to land in it
    however loaded the machine is."""
    async with httpx.AsyncClient() as client:
        baseline = await generated_tokens(client, url)
        answer = asyncio.create_task(answering)
        while await generated_tokens(client, url) <= baseline:
            assert not answer.done(), "the answer ended before the server counted a token"
            await asyncio.sleep(0.01)
    assert not answer.done(), "the answer ended while it was paced"
    return answer


async def test_a_session_s_turns_are_the_servers_tokens_and_the_trainers_logprobs(
    vllm_server: Served,
) -> None:
    engine = client_of(vllm_server)
    prompt = list(vllm_server.checkpoints.prompt)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=3)
    try:
        session = await engine.open_session()
        first = await engine.generate(
            GenerateRequest(
                input_ids=tuple(prompt), sampling=sampling, session=SessionRef(session_id=session)
            )
        )
        follow = (*TEMPLATE.tokenizer.encode("more"), TEMPLATE.tokenizer.end_id)
        second = await engine.generate(
            GenerateRequest(
                input_ids=follow,
                sampling=sampling,
                session=SessionRef(session_id=session, parent_rid=first.rid),
            )
        )
        await engine.close_session(session)
        version = await engine.current_version()
    finally:
        await engine.close()

    assert len(first.output_ids) == len(first.logprobs) > 0
    assert {s.version for s in first.weight_versions} == {version}
    # The second turn's context is the first's prompt and answer, then its own tokens:
    # the server found the shared prefix in its cache.
    context = [*prompt, *first.output_ids, *follow]
    assert second.prompt_tokens == len(context)
    assert second.cached_tokens > 0
    # The trainer's log-probs of the same tokens under the same weights (float32 both).
    model = load_model(vllm_server.checkpoints.policy)
    for ids, result in ((prompt, first), (context, second)):
        ours = score(model, [*ids, *result.output_ids], 0.7, start=len(ids))
        assert ours == pytest.approx(result.logprobs, abs=2e-3)


async def test_stop_tokens_and_max_tokens(vllm_server: Served) -> None:
    engine = client_of(vllm_server)
    end = TEMPLATE.tokenizer.end_id
    try:
        # The taught answer is a tool call closed by <|end|>: greedy, it stops there.
        stopped = await engine.generate(
            GenerateRequest(
                input_ids=vllm_server.checkpoints.prompt,
                sampling=SamplingParams(temperature=0.0, max_new_tokens=200, stop_token_ids=(end,)),
            )
        )
        capped = await engine.generate(
            GenerateRequest(
                input_ids=vllm_server.checkpoints.prompt,
                sampling=SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(end,)),
            )
        )
    finally:
        await engine.close()
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] == end
    assert "<|tool_call|>" in TEMPLATE.tokenizer.decode(stopped.output_ids[:-1])
    assert capped.finish_reason == "length" and len(capped.output_ids) == 5
    assert capped.output_ids == stopped.output_ids[:5]


async def test_a_caller_abort_ends_its_request(vllm_server: Served) -> None:
    engine = client_of(vllm_server)
    request = GenerateRequest(
        input_ids=(TEMPLATE.tokenizer.bos_id,),
        sampling=SamplingParams(max_new_tokens=LONG),
    )
    try:
        with vllm_server.paced(PACE):
            running = await started(vllm_server.url, engine.generate(request))
            await engine.abort(request.rid)
            result = await asyncio.wait_for(running, 60)
    finally:
        await engine.close()
    assert result.finish_reason == "abort"
    assert len(result.output_ids) < LONG


@pytest.mark.parametrize("interrupt", [PauseMode.RETRACT, PauseMode.ABORT])
async def test_a_publish_mid_answer_splits_its_spans(
    vllm_server: Served, interrupt: PauseMode
) -> None:
    """`retract` is vLLM's `keep`: the answer goes on in the server on the new weights;
    `abort` ends it and the runtime sends the rest again. Either way the answer's tokens
    carry the version that made them."""
    engine = client_of(vllm_server)
    runtime = PolicyRuntime(
        engine=engine,
        template=TEMPLATE,
        sampling=SamplingParams(max_new_tokens=LONG),
        max_context=1024,
        interrupt=interrupt,
    )
    checkpoints = vllm_server.checkpoints
    try:
        before = await engine.current_version()
        request = GenerateRequest(
            input_ids=(TEMPLATE.tokenizer.bos_id,), sampling=SamplingParams(max_new_tokens=LONG)
        )
        with vllm_server.paced(PACE):
            answer = await started(vllm_server.url, runtime.generate(request))
            switched = await runtime.update_weights(
                WeightUpdate(path=str(checkpoints.other), version=before + 1)
            )
        result = await asyncio.wait_for(answer, 120)
        # Back to the served policy, as a newer version still, for the other tests.
        await runtime.update_weights(WeightUpdate(path=str(checkpoints.policy), version=before + 2))
    finally:
        await engine.close()
    assert switched == before + 1
    assert len(result.output_ids) == LONG and result.finish_reason == "length"
    spans = result.weight_versions
    assert [s.version for s in spans] == [before, before + 1]
    assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == LONG
    assert runtime.resubmitted == (1 if interrupt is PauseMode.ABORT else 0)
    # The old weights' KV went: retract preempts the kept request with the prefix cache.
    assert engine.prefix_cache_resets_refused == 0


async def test_a_version_that_does_not_fit_is_refused_and_the_server_serves_on(
    vllm_server: Served,
) -> None:
    engine = client_of(vllm_server)
    try:
        before = await engine.current_version()
        with pytest.raises(EngineRequestError, match="do not fit the served model") as refused:
            await engine.update_weights(
                WeightUpdate(path=str(vllm_server.checkpoints.misfit), version=before + 1)
            )
        after = await engine.generate(
            GenerateRequest(
                input_ids=vllm_server.checkpoints.prompt, sampling=SamplingParams(max_new_tokens=3)
            )
        )
        assert await engine.current_version() == before
    finally:
        await engine.close()
    assert "embed_tokens" in str(refused.value)  # the misfit tensors are named
    assert [s.version for s in after.weight_versions] == [before]
    assert vllm_server.server.alive()


async def test_after_a_publish_the_server_serves_the_new_weights_exactly(
    vllm_server: Served,
) -> None:
    """A version loaded with `reload_weights` is the trainer's to float precision (the
    published directory drops the tied output embedding, as the trainer writes it)."""
    engine = client_of(vllm_server)
    checkpoints = vllm_server.checkpoints
    prompt = list(checkpoints.prompt)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    try:
        before = await engine.current_version()
        await engine.pause(PauseMode.RETRACT)
        await engine.update_weights(WeightUpdate(path=str(checkpoints.other), version=before + 1))
        await engine.resume()
        result = await engine.generate(GenerateRequest(input_ids=tuple(prompt), sampling=sampling))
        await engine.update_weights(WeightUpdate(path=str(checkpoints.policy), version=before + 2))
    finally:
        await engine.close()
    assert [s.version for s in result.weight_versions] == [before + 1]
    ours = score(
        load_model(checkpoints.other), [*prompt, *result.output_ids], 1.0, start=len(prompt)
    )
    assert ours == pytest.approx(result.logprobs, abs=2e-3)

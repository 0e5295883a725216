"""`/generate` with `stream: true`: the mock worker on a real LocalEngine sends a chunk per
decode step, and `SGLangEngine.generate_observed` shows them as they come and ends with
the answer a plain request gives; `StreamedAnswer` reads both of SGLang's chunk forms."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentflow.errors import EngineError
from agentflow.inference.base import GenerateRequest, SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.inference.sglang_http import RetryPolicy
from agentflow.inference.sglang_wire import StreamedAnswer
from agentflow.modeling import ModelInit
from tests.support.mock_sglang import create_mock_worker

TINY = ModelInit(layers=1, hidden=32, heads=2, max_context=256)


@pytest.fixture
async def engine() -> AsyncIterator[SGLangEngine]:
    local = LocalEngine.from_init(TINY, seed=0, max_batch_size=4)
    transport = httpx.ASGITransport(app=create_mock_worker(local))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
        settings = SGLangSettings(url="http://worker", retry=RetryPolicy(max_attempts=1))
        yield SGLangEngine(settings, client=http)
    await local.close()


def request(rid: str) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, top_logprobs=2)
    return GenerateRequest(input_ids=(1, 2, 3, 4), sampling=sampling, rid=rid)


async def test_tokens_arrive_in_chunks_and_add_up_to_the_answer(engine: SGLangEngine) -> None:
    chunks: list[tuple[list[int], list[float]]] = []
    streamed = await engine.generate_observed(
        request("streamed"), lambda ids, lps: chunks.append((list(ids), list(lps)))
    )
    plain = await engine.generate(request("plain"))
    assert len(chunks) >= 2  # the local engine decodes in bursts of at most 8 tokens
    assert [t for ids, _ in chunks for t in ids] == streamed.output_ids == plain.output_ids
    assert [lp for _, lps in chunks for lp in lps] == pytest.approx(streamed.logprobs)
    assert streamed.logprobs == pytest.approx(plain.logprobs)
    assert streamed.top_logprobs is not None and len(streamed.top_logprobs) == 24
    assert streamed.finish_reason == plain.finish_reason == "length"


def _chunk(ids: list[int], total: int, entries: list[list[object]]) -> dict[str, object]:
    meta = {"completion_tokens": total, "output_token_logprobs": entries}
    return {"output_ids": ids, "meta_info": meta}


def test_cumulative_and_incremental_chunks_read_alike() -> None:
    entries = [[-0.5, 7, None], [-0.25, 8, None], [-1.0, 9, None]]
    cumulative, incremental = StreamedAnswer(), StreamedAnswer()
    assert cumulative.add(_chunk([7], 1, entries[:1])) == ([7], [-0.5])
    assert cumulative.add(_chunk([7, 8, 9], 3, entries)) == ([8, 9], [-0.25, -1.0])
    assert incremental.add(_chunk([7], 1, entries[:1])) == ([7], [-0.5])
    assert incremental.add(_chunk([8, 9], 3, entries[1:])) == ([8, 9], [-0.25, -1.0])
    for answer in (cumulative.answer(), incremental.answer()):
        assert answer["output_ids"] == [7, 8, 9]
        assert answer["meta_info"]["output_token_logprobs"] == entries


def test_a_chunk_that_does_not_fit_is_an_error() -> None:
    streamed = StreamedAnswer()
    streamed.add(_chunk([7, 8], 2, [[-0.5, 7, None], [-0.5, 8, None]]))
    with pytest.raises(EngineError):
        streamed.add(_chunk([7, 9, 10], 3, [[-0.5, 7, None]] * 3))  # rewrites a token

"""The mock SGLang worker: 0.5.23's schema and answer shapes, and SGLangEngine against it.

The worker runs in process (httpx.ASGITransport) over a deterministic `MockEngine`: the
next token depends only on the previous token and the weight version, so a request
continued from `input_ids + partial output` produces exactly what an uninterrupted request
would, and stitching can be checked token for token. Each token takes a few ms so a pause
can land mid-generation. The integration tests run the worker with the real LocalEngine
behind the real router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from agentflow.errors import EngineRequestError
from agentflow.inference.base import (
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.inference.sglang_http import RetryPolicy
from tests.support.engine import MockEngine
from tests.support.mock_sglang import create_mock_worker

VOCAB = 64


def next_token(prev: int, version: int) -> int:
    return (prev * 7 + 3 + version) % VOCAB


def chain(request: GenerateRequest, engine: MockEngine) -> Iterator[tuple[int, float]]:
    """Each token from the one before and the weights of its step, with its log-prob."""
    prev = engine.contexts[request.rid][-1]
    while True:
        prev = next_token(prev, engine.weight_version)
        yield prev, -((prev % 5) + 1) / 10


# What sglang-router 0.3.2 forwards for a plain /generate (it re-serializes bodies).
ROUTER_BODY: dict[str, Any] = {
    "model": None,
    "input_ids": [5, 6, 7],
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "top_p": 1.0},
    "return_logprob": True,
    "logprob_start_len": -1,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "rid": "r-1",
}


@pytest.fixture
def fake() -> MockEngine:
    return MockEngine(chain, step_s=0.002, model="fake", vocab_size=VOCAB, max_context=512)


@pytest.fixture
async def http(fake: MockEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_mock_worker(fake, model_path="/models/fake")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        yield client


@pytest.fixture
async def engine(http: httpx.AsyncClient) -> SGLangEngine:
    settings = SGLangSettings(
        url="http://worker", resubmit_aborted=True, retry=RetryPolicy(max_attempts=1)
    )
    return SGLangEngine(settings, client=http)


async def test_router_shaped_body_gets_sglang_shaped_answer(http: httpx.AsyncClient) -> None:
    resp = await http.post("/generate", json=ROUTER_BODY)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    expected, prev = [], 7
    for _ in range(4):
        prev = next_token(prev, 0)
        expected.append(prev)
    assert body["output_ids"] == expected
    meta = body["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["weight_version"] == "0"
    assert [entry[1] for entry in meta["output_token_logprobs"]] == expected
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sampling_params": {"max_new_tokens": 2, "bogus": 1}}, "Unknown sampling parameter"),
        ({"sampling_params": {"top_k": 5}}, "top_k"),
        ({"unknown_top": 1}, "unknown /generate keys"),
        ({"input_ids": None, "text": "hi"}, "text"),
        ({"input_ids": [[1, 2], [3]]}, "batched"),
        ({"input_ids": []}, "input_ids"),
        ({"sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": [1, 999]}, "vocabulary"),
        ({"session_params": {"id": "nope"}}, "unknown session"),
        ({"image_data": ["data:image/png;base64,AAAA"]}, "no image understanding"),
    ],
)
async def test_bad_requests_get_400(
    http: httpx.AsyncClient, change: dict[str, Any], message: str
) -> None:
    body = {**ROUTER_BODY, **change}
    body = {k: v for k, v in body.items() if v is not None or k == "model"}
    resp = await http.post("/generate", json=body)
    assert resp.status_code == 400
    assert message in resp.json()["error"]["message"]


async def test_stop_token_ends_generation(engine: SGLangEngine) -> None:
    stop = next_token(next_token(7, 0), 0)
    result = await engine.generate(
        GenerateRequest(
            input_ids=(7,), sampling=SamplingParams(max_new_tokens=9, stop_token_ids=(stop,))
        )
    )
    assert result.finish_reason == "stop"
    assert result.output_ids[-1] == stop and len(result.output_ids) == 2


async def test_sessions_continue_from_the_parent(engine: SGLangEngine, fake: MockEngine) -> None:
    sid = await engine.open_session()
    first = await engine.generate(
        GenerateRequest(
            input_ids=(1, 2),
            sampling=SamplingParams(max_new_tokens=3),
            rid="t1",
            session=SessionRef(session_id=sid),
        )
    )
    second = await engine.generate(
        GenerateRequest(
            input_ids=(9,),
            sampling=SamplingParams(max_new_tokens=2),
            rid="t2",
            session=SessionRef(session_id=sid, parent_rid="t1"),
        )
    )
    assert second.prompt_tokens == 2 + 3 + 1 and second.cached_tokens == 5
    assert fake.sessions[sid]["t2"][:5] == [1, 2, *first.output_ids]
    with pytest.raises(EngineRequestError, match="unknown parent rid"):
        await engine.generate(
            GenerateRequest(input_ids=(1,), session=SessionRef(session_id=sid, parent_rid="zz"))
        )
    with pytest.raises(EngineRequestError, match="already exists"):
        await engine.open_session(sid)
    await engine.close_session(sid)
    assert sid not in fake.sessions


async def test_pause_abort_resume_is_stitched_not_restarted(
    engine: SGLangEngine, fake: MockEngine, http: httpx.AsyncClient
) -> None:
    req = GenerateRequest(input_ids=(3,), sampling=SamplingParams(max_new_tokens=40), rid="long")
    task = asyncio.create_task(engine.generate(req))
    await fake.started.wait()
    await engine.pause(PauseMode.ABORT)
    assert await engine.update_weights(WeightUpdate(path="/models/v1")) == 1
    await engine.resume()
    result = await task

    log = (await http.get("/mock/requests")).json()
    first, second = log
    produced = len(second["input_ids"]) - 1
    assert 0 < produced < 40, "the pause should land mid-generation"
    assert second["input_ids"][1:] == result.output_ids[:produced]
    assert second["max_new_tokens"] == 40 - produced
    assert len(result.output_ids) == 40 and result.finish_reason == "length"
    assert result.token_versions() == [0] * produced + [1] * (40 - produced)
    # Continuing from the partial output is exactly where an uninterrupted run would be.
    prev, expected = 3, []
    for version in result.token_versions():
        prev = next_token(prev, version)
        expected.append(prev)
    assert result.output_ids == expected
    assert [u.path for u in fake.updates] == ["/models/v1"]
    assert (await engine.info()).model == "/models/v1"


async def test_requests_wait_while_paused(engine: SGLangEngine, http: httpx.AsyncClient) -> None:
    await engine.pause(PauseMode.RETRACT)
    task = asyncio.create_task(
        engine.generate(
            GenerateRequest(input_ids=(1,), sampling=SamplingParams(max_new_tokens=4), rid="held")
        )
    )
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert (await http.get("/mock/state")).json()["held"] == ["held"]
    assert not task.done()
    await engine.resume()
    assert (await task).finish_reason == "length"


async def test_abort_of_a_held_request(engine: SGLangEngine, http: httpx.AsyncClient) -> None:
    await engine.pause(PauseMode.IN_PLACE)
    task = asyncio.create_task(engine.generate(GenerateRequest(input_ids=(1,), rid="gone")))
    while not (await http.get("/mock/state")).json()["held"]:
        await asyncio.sleep(0.005)
    await engine.abort("gone")
    result = await task
    assert result.finish_reason == "abort" and result.output_ids == []


async def test_weight_update_failure_and_versions(
    engine: SGLangEngine, http: httpx.AsyncClient
) -> None:
    with pytest.raises(EngineRequestError, match="no model"):
        await engine.update_weights(WeightUpdate(path="/missing/dir", version=3))
    assert await engine.update_weights(WeightUpdate(path="/m2", version=4)) == 4
    assert (await engine.info()).weight_version == 4
    resp = await http.post("/update_weights_from_disk", json={"model_path": "/x", "bogus": 1})
    assert resp.status_code == 400


async def test_nccl_routes_check_the_schema_then_say_unsupported(
    engine: SGLangEngine, http: httpx.AsyncClient
) -> None:
    with pytest.raises(EngineRequestError, match="NCCL"):
        await engine.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=29500,
            rank_offset=1,
            world_size=2,
            group_name="g",
        )
    resp = await http.post("/update_weights_from_distributed", json={"names": ["w"]})
    assert resp.status_code == 400 and "dtypes" in resp.text
    resp = await http.post(
        "/update_weights_from_distributed",
        json={"names": ["w"], "dtypes": ["float32"], "shapes": [[1], [2]]},
    )
    assert resp.status_code == 400 and "length" in resp.text


async def test_info_and_health(engine: SGLangEngine, http: httpx.AsyncClient) -> None:
    info = await engine.info()
    assert (info.model, info.max_context, info.weight_version) == ("/models/fake", 512, 0)
    assert await engine.health()
    assert (await http.get("/health_generate")).status_code == 200
    assert (await http.get("/get_model_info")).json()["weight_version"] == "0"


def test_cli_needs_exactly_one_model_source() -> None:
    from tests.support.mock_sglang import _parse_args

    args = _parse_args(["--port", "9", "--model-init", '{"layers": 1}'])
    assert (args.port, args.model_init, args.model_path) == (9, '{"layers": 1}', None)
    with pytest.raises(SystemExit):
        _parse_args(["--port", "9"])
    with pytest.raises(SystemExit):
        _parse_args(["--port", "9", "--model-init", "{}", "--model-path", "/m"])

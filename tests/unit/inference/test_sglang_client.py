"""SGLangEngine against scripted HTTP answers (httpx.MockTransport): bodies, parsing, retries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentflow.errors import EngineError, EngineRequestError, EngineUnavailable
from agentflow.inference.base import (
    Engine,
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.inference.sglang_http import RetryPolicy
from agentflow.inference.sglang_router import RouterWorkers

FAST = RetryPolicy(max_attempts=3, backoff_s=0.0, backoff_max_s=0.0)
Handler = Callable[[httpx.Request], Any]


def answer(output_ids: list[int], reason: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {
        "output_ids": output_ids,
        "meta_info": {
            "id": meta.pop("id", "r"),
            "finish_reason": reason,
            "prompt_tokens": meta.pop("prompt_tokens", 3),
            "completion_tokens": len(output_ids),
            "cached_tokens": meta.pop("cached_tokens", 0),
            "weight_version": meta.pop("weight_version", "0"),
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(output_ids)],
            **meta,
        },
    }


class Recorder:
    """Counts calls per path and hands each request to a scripted handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        result = self.handler(request)
        if asyncio.iscoroutine(result):
            result = await result
        if isinstance(result, httpx.Response):
            return result
        return httpx.Response(200, json=result)

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def calls(self, path: str) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.path == path]


def engine_with(handler: Handler, **settings: Any) -> tuple[SGLangEngine, Recorder]:
    recorder = Recorder(handler)
    client = httpx.AsyncClient(transport=httpx.MockTransport(recorder))
    settings.setdefault("url", "http://router:30000")
    settings.setdefault("retry", FAST)
    return SGLangEngine(SGLangSettings(**settings), client=client), recorder


def test_it_is_an_engine() -> None:
    eng, _ = engine_with(lambda r: {})
    assert isinstance(eng, Engine)


async def test_generate_body_header_and_parsed_result() -> None:
    meta = {
        "cached_tokens": 2,
        "prompt_tokens": 5,
        "weight_version": "4",
        "weight_versions": [
            {"version": "3", "start": 0, "end": 1},
            {"version": "4", "start": 1, "end": 2},
        ],
    }
    eng, rec = engine_with(lambda r: answer([7, 9], {"type": "stop", "matched": 9}, **meta))
    req = GenerateRequest(
        input_ids=(1, 2, 3),
        sampling=SamplingParams(
            temperature=0.7, top_p=0.9, max_new_tokens=5, stop_token_ids=(9,), seed=11
        ),
        rid="r1",
        session=SessionRef(session_id="s", parent_rid="p", offset=4),
        routing_key="s",
    )
    result = await eng.generate(req)

    (body,) = rec.bodies("/generate")
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "max_new_tokens": 5,
            "stop_token_ids": [9],
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "r1",
        "session_params": {"id": "s", "rid": "p", "offset": 4},
    }
    assert rec.calls("/generate")[0].headers["x-smg-routing-key"] == "s"
    assert result.output_ids == [7, 9]
    assert result.logprobs == [-0.5, -1.5]
    assert result.finish_reason == "stop"
    assert result.token_versions() == [3, 4]
    assert (result.prompt_tokens, result.cached_tokens) == (5, 2)


async def test_no_seed_no_session_no_header() -> None:
    eng, rec = engine_with(lambda r: answer([1], {"type": "length", "length": 1}))
    await eng.generate(GenerateRequest(input_ids=(5,), rid="x"))
    (body,) = rec.bodies("/generate")
    assert "sampling_seed" not in body["sampling_params"]
    assert "session_params" not in body
    assert "image_data" not in body
    assert "x-smg-routing-key" not in rec.calls("/generate")[0].headers


async def test_images_go_as_image_data_and_support_is_asked_once() -> None:
    def handler(request: httpx.Request) -> Any:
        if request.url.path == "/model_info":
            return {"model_path": "m", "weight_version": "0", "has_image_understanding": True}
        return answer([1], {"type": "length", "length": 1})

    eng, rec = engine_with(handler)
    urls = ("data:image/png;base64,iVBORw0KGgo=", "data:image/jpeg;base64,/9j/4A==")
    await eng.generate(GenerateRequest(input_ids=(5, 6), rid="x", image_data=urls))
    (body,) = rec.bodies("/generate")
    assert body["image_data"] == list(urls)
    assert await eng.accepts_images() and await eng.accepts_images()
    assert len(rec.calls("/model_info")) == 1
    text_only, rec = engine_with(lambda r: {"model_path": "m", "has_image_understanding": False})
    assert not await text_only.accepts_images()
    told, rec = engine_with(lambda r: {}, accepts_images=True)
    assert await told.accepts_images() and rec.requests == []


async def test_retries_5xx_then_succeeds() -> None:
    codes = iter([503, 500])

    def handler(r: httpx.Request) -> Any:
        if r.url.path != "/generate":
            return httpx.Response(200)
        code = next(codes, 200)
        if code != 200:
            return httpx.Response(code, json={"error": {"message": "busy"}})
        return answer([1], {"type": "length", "length": 1})

    eng, rec = engine_with(handler)
    result = await eng.generate(GenerateRequest(input_ids=(5,)))
    assert result.output_ids == [1]
    assert len(rec.calls("/generate")) == 3


async def test_retries_transport_errors() -> None:
    failures = iter([httpx.ConnectError("refused"), httpx.ReadError("reset")])

    def handler(r: httpx.Request) -> Any:
        if r.url.path != "/generate":
            return httpx.Response(200)
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return answer([1], {"type": "length", "length": 1})

    eng, rec = engine_with(handler)
    assert (await eng.generate(GenerateRequest(input_ids=(5,)))).output_ids == [1]
    assert len(rec.calls("/generate")) == 3


async def test_4xx_is_never_retried() -> None:
    eng, rec = engine_with(
        lambda r: httpx.Response(400, json={"error": {"message": "Unknown sampling parameter"}})
    )
    with pytest.raises(EngineRequestError, match="Unknown sampling parameter"):
        await eng.generate(GenerateRequest(input_ids=(5,)))
    assert len(rec.calls("/generate")) == 1


async def test_gives_up_after_max_attempts() -> None:
    eng, rec = engine_with(lambda r: httpx.Response(502, text="bad gateway"))
    with pytest.raises(EngineUnavailable, match="3 attempt"):
        await eng.generate(GenerateRequest(input_ids=(5,)))
    assert len(rec.calls("/generate")) == 3


async def test_per_attempt_timeout_is_retried() -> None:
    calls = 0

    async def handler(r: httpx.Request) -> Any:
        nonlocal calls
        calls += r.url.path == "/generate"
        if calls == 1 and r.url.path == "/generate":
            await asyncio.sleep(5)  # hangs past the per-attempt limit
        return answer([1], {"type": "length", "length": 1})

    eng, rec = engine_with(handler, generate_timeout_s=0.05)
    assert (await eng.generate(GenerateRequest(input_ids=(5,), rid="slow"))).output_ids == [1]
    assert [r.url.path for r in rec.requests] == ["/generate", "/abort_request", "/generate"]
    assert rec.bodies("/abort_request") == [{"rid": "slow"}]  # frees the rid before retrying


@pytest.mark.parametrize(
    "bad",
    [
        {"output_ids": [1]},  # no meta_info
        {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1}},
        {
            "output_ids": [1],
            "meta_info": {
                "finish_reason": {"type": "length"},
                "prompt_tokens": 1,
                "output_token_logprobs": [[-0.1, 2, None]],  # id does not match
            },
        },
        {
            "output_ids": [1],
            "meta_info": {
                "finish_reason": None,
                "prompt_tokens": 1,
                "output_token_logprobs": [[-0.1, 1, None]],
            },
        },
    ],
)
async def test_malformed_answers_are_engine_errors(bad: dict[str, Any]) -> None:
    eng, _ = engine_with(lambda r: bad)
    with pytest.raises(EngineError):
        await eng.generate(GenerateRequest(input_ids=(5,)))


def scripted_resubmission() -> Callable[[httpx.Request], Any]:
    """First /generate is aborted after 3 tokens (v0); the continuation gives 2 more (v1)."""
    generates = 0

    def handler(r: httpx.Request) -> Any:
        nonlocal generates
        if r.url.path != "/generate":
            return {"status": "ok"}
        generates += 1
        if generates == 1:
            return answer([4, 5, 6], {"type": "abort", "message": "paused"}, weight_version="0")
        return answer([7, 8], {"type": "length", "length": 2}, weight_version="1", prompt_tokens=6)

    return handler


async def test_aborted_request_is_resubmitted_after_resume_and_stitched() -> None:
    eng, rec = engine_with(scripted_resubmission(), resubmit_aborted=True)
    await eng.pause(PauseMode.ABORT)
    req = GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=5), rid="r")
    task = asyncio.create_task(eng.generate(req))
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(rec.calls("/generate")) == 1, "resubmitted before resume()"
    await eng.resume()
    result = await task

    first, second = rec.bodies("/generate")
    assert second["input_ids"] == [1, 2, 3, 4, 5, 6]
    assert second["sampling_params"]["max_new_tokens"] == 2
    assert second["rid"] == first["rid"] == "r"
    assert result.output_ids == [4, 5, 6, 7, 8]
    assert result.logprobs == [-0.5, -1.5, -2.5, -0.5, -1.5]
    assert result.finish_reason == "length"
    assert [(s.version, s.start, s.end) for s in result.weight_versions] == [(0, 0, 3), (1, 3, 5)]
    assert result.prompt_tokens == 3


async def test_abort_is_returned_when_resubmission_is_off() -> None:
    eng, rec = engine_with(scripted_resubmission())
    result = await eng.generate(
        GenerateRequest(input_ids=(1,), sampling=SamplingParams(max_new_tokens=5))
    )
    assert result.finish_reason == "abort"
    assert len(rec.calls("/generate")) == 1


async def test_request_aborted_by_the_caller_is_not_resubmitted() -> None:
    gate = asyncio.Event()

    async def handler(r: httpx.Request) -> Any:
        if r.url.path == "/generate":
            await gate.wait()
            return answer([4], {"type": "abort", "message": "aborted"})
        gate.set()
        return httpx.Response(200)

    eng, rec = engine_with(handler, resubmit_aborted=True)
    task = asyncio.create_task(eng.generate(GenerateRequest(input_ids=(1,), rid="mine")))
    await asyncio.sleep(0.01)
    await eng.abort("mine")
    assert (await task).finish_reason == "abort"
    assert len(rec.calls("/generate")) == 1
    assert rec.bodies("/abort_request") == [{"rid": "mine"}]


async def test_control_routes_go_to_every_worker() -> None:
    eng, rec = engine_with(
        lambda r: "sess" if r.url.path == "/open_session" else {"status": "ok"},
        worker_urls=("http://w1:1", "http://w2:2/"),
    )
    assert await eng.open_session("sess") == "sess"
    await eng.pause(PauseMode.RETRACT)
    await eng.resume()
    await eng.close_session("sess")
    hosts = {(r.url.host, r.url.path) for r in rec.requests}
    for path in ("/open_session", "/pause_generation", "/continue_generation", "/close_session"):
        assert {("w1", path), ("w2", path)} <= hosts
    assert rec.bodies("/pause_generation")[0] == {"mode": "retract"}
    assert rec.bodies("/open_session")[0] == {
        "capacity_of_str_len": eng.settings.session_capacity,
        "session_id": "sess",
    }


async def test_behind_router_discovers_workers() -> None:
    def handler(r: httpx.Request) -> Any:
        if r.url.path == "/workers":
            return {
                "workers": [
                    {"id": "a", "url": "http://w1:1", "is_healthy": True},
                    {"id": "b", "url": "http://w2:2", "is_healthy": True},
                ]
            }
        return {"status": "ok"}

    eng, rec = engine_with(handler, behind_router=True)
    await eng.pause()
    assert {r.url.host for r in rec.calls("/pause_generation")} == {"w1", "w2"}
    assert rec.calls("/workers")[0].url.host == "router"


async def test_update_weights_from_disk_counts_versions() -> None:
    def handler(r: httpx.Request) -> Any:
        if r.url.path == "/model_info":
            return {"model_path": "/m", "weight_version": "default"}
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    eng, rec = engine_with(handler)
    assert await eng.update_weights(WeightUpdate(path="/ckpt/1")) == 1
    assert await eng.update_weights(WeightUpdate(path="/ckpt/2")) == 2
    assert await eng.update_weights(WeightUpdate(path="/ckpt/9", version=9)) == 9
    assert rec.bodies("/update_weights_from_disk") == [
        {"model_path": "/ckpt/1", "weight_version": "1"},
        {"model_path": "/ckpt/2", "weight_version": "2"},
        {"model_path": "/ckpt/9", "weight_version": "9"},
    ]
    assert len(rec.calls("/model_info")) == 1


async def test_failed_weight_update_is_a_request_error() -> None:
    eng, _ = engine_with(lambda r: {"success": False, "message": "no such dir"})
    with pytest.raises(EngineRequestError, match="no such dir"):
        await eng.update_weights(WeightUpdate(path="/nope", version=1))
    with pytest.raises(EngineRequestError, match="directory"):
        await eng.update_weights(WeightUpdate(state_dict={}, version=1))


async def test_distributed_update_bodies() -> None:
    eng, rec = engine_with(lambda r: {"success": True, "message": ""})
    await eng.init_weights_update_group(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=2, group_name="g"
    )
    assert rec.bodies("/init_weights_update_group") == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "nccl",
        }
    ]
    version = await eng.update_weights_from_distributed(
        names=["w"], dtypes=["torch.bfloat16"], shapes=[[2, 3]], group_name="g", version=5
    )
    assert version == 5
    assert rec.bodies("/update_weights_from_distributed") == [
        {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 3]],
            "group_name": "g",
            "flush_cache": True,
            "weight_version": "5",
        }
    ]
    await eng.update_weights_from_tensor(["payload"], version=6)
    assert rec.bodies("/update_weights_from_tensor") == [
        {"serialized_named_tensors": ["payload"], "flush_cache": True, "weight_version": "6"}
    ]
    with pytest.raises(ValueError, match="rank_offset"):
        await eng.init_weights_update_group(
            master_address="h", master_port=1, rank_offset=0, world_size=2, group_name="g"
        )


async def test_weight_broadcast_is_not_retried() -> None:
    eng, rec = engine_with(lambda r: httpx.Response(503))
    with pytest.raises(EngineUnavailable):
        await eng.update_weights_from_distributed(
            names=["w"], dtypes=["float32"], shapes=[[1]], group_name="g", version=1
        )
    assert len(rec.requests) == 1


async def test_router_workers_add_and_remove_wait_for_the_change() -> None:
    listed: list[dict[str, Any]] = []
    polls = 0

    def handler(r: httpx.Request) -> Any:
        nonlocal polls
        if r.method == "POST":
            listed.append({"id": "w9", "url": json.loads(r.content)["url"], "is_healthy": False})
            return httpx.Response(202, json={"status": "accepted", "worker_id": "w9"})
        if r.method == "DELETE":
            return httpx.Response(202, json={"status": "accepted"})
        polls += 1
        if polls == 2 and listed:
            listed[0]["is_healthy"] = True  # healthy on the second look
        if polls == 4:
            listed.clear()  # removal lands on the fourth look
        return {"workers": listed, "total": len(listed)}

    client = httpx.AsyncClient(transport=httpx.MockTransport(Recorder(handler)))
    workers = RouterWorkers("http://router:1", client=client, policy=FAST)
    assert await workers.add("http://w9:9") == "w9"
    assert polls == 2
    await workers.remove("w9")
    assert polls == 4 and not listed


async def test_open_session_names_the_session_for_every_worker() -> None:
    eng, rec = engine_with(
        lambda r: json.loads(r.content)["session_id"], worker_urls=("http://w1:1", "http://w2:2")
    )
    sid = await eng.open_session()
    bodies = rec.bodies("/open_session")
    assert len(bodies) == 2 and {b["session_id"] for b in bodies} == {sid}

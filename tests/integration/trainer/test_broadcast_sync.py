"""Broadcast weight sync (`sync = "nccl"`) to a mock SGLang worker in its own process.

The worker joins the trainer's group for real (gloo on CPU: the same calls NCCL takes on
GPUs) and receives every bucket. Checked: the request sequence SGLang sees (the group
joined once; per version one `/update_weights_from_distributed` per bucket, in order,
the cache flushed with the last), that the worker then serves the new weights (its
greedy log-probs equal the new model's teacher-forced ones), and, first, that a worker
that cannot join fails the publish, naming why, without hanging the trainer.
"""

from __future__ import annotations

import subprocess
from typing import Any

import httpx
import pytest

from agentflow.inference.base import GenerateRequest, SamplingParams
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.modeling import score
from tests.integration.trainer.test_weight_sync import (
    PROMPT,
    _wait_healthy,
    mock_worker,  # noqa: F401  # the fixture
    model,
)
from trainer.broadcast_sync import BroadcastPublisher, BroadcastSettings
from trainer.weights import WeightSyncError

pytestmark = pytest.mark.integration

SETTINGS = BroadcastSettings(backend="gloo", device="cpu", bucket_bytes=64 * 1024, timeout_s=60)


async def _served_logprobs(engine: SGLangEngine) -> tuple[list[int], list[float], list[int]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    result = await engine.generate(GenerateRequest(input_ids=PROMPT, sampling=greedy))
    return list(result.output_ids), list(result.logprobs), result.token_versions()


def _control(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/mock/control").json()


async def test_versions_reach_the_worker_bucket_by_bucket(
    mock_worker: tuple[str, subprocess.Popen[bytes]],  # noqa: F811
) -> None:
    url, proc = mock_worker
    _wait_healthy(url, proc)
    engine = SGLangEngine(SGLangSettings(url=url))
    # First a worker that cannot join: NCCL needs a GPU it does not have. It refuses, and
    # the trainer's side of the rendezvous gives up after its timeout, not waiting for ever.
    refused = BroadcastPublisher(
        [engine], SETTINGS.model_copy(update={"backend": "nccl", "timeout_s": 3})
    )
    with pytest.raises(WeightSyncError) as failed:
        await refused.publish(model(7).state_dict(), 1)
    assert refused.published_version == 0
    assert "NCCL needs a GPU" in str(failed.value)
    refused.close()

    publisher = BroadcastPublisher([engine], SETTINGS)
    try:
        for version, seed in ((1, 7), (2, 8)):
            trained = model(seed)
            state = trained.state_dict()
            report = await publisher.publish(state, version)
            assert report.mode == "nccl" and [t.version for t in report.targets] == [version]
            assert publisher.published_version == version
            output, logprobs, versions = await _served_logprobs(engine)
            assert versions == [version] * len(output)
            expected = score(trained, [*PROMPT, *output], temperature=1.0, start=len(PROMPT))
            assert logprobs == pytest.approx(expected, abs=1e-4)
    finally:
        publisher.close()
        await engine.close()

    calls = _control(url)
    assert calls[0]["body"]["backend"] == "nccl"  # the refused join
    calls = calls[1:]
    routes = [c["route"] for c in calls]
    assert routes.count("/init_weights_update_group") == 1  # the group is formed once
    joined = calls[0]["body"]
    assert (joined["rank_offset"], joined["world_size"], joined["backend"]) == (1, 2, "gloo")
    updates = [c["body"] for c in calls if c["route"] == "/update_weights_from_distributed"]
    by_version: dict[str, list[dict[str, Any]]] = {}
    for body in updates:
        assert body["group_name"] == joined["group_name"]
        by_version.setdefault(body["weight_version"], []).append(body)
    assert list(by_version) == ["1", "2"]
    # Tied output layer sent once, as the embedding; every other weight exactly once.
    expected_names = [n for n in state if n != "lm_head.weight"]
    for buckets in by_version.values():
        assert len(buckets) > 1  # 64 KiB buckets: the model needs several
        assert [n for b in buckets for n in b["names"]] == expected_names
        assert [b["flush_cache"] for b in buckets] == [False] * (len(buckets) - 1) + [True]
        for body in buckets:
            assert body["dtypes"] == ["float32"] * len(body["names"])
            assert [state[n].shape for n in body["names"]] == [tuple(s) for s in body["shapes"]]

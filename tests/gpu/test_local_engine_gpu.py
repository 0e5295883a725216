"""LocalEngine on CUDA: consistency with teacher forcing, continuous batching, sessions,
and a weight switch mid-generation. Skipped where no CUDA device exists.

`AGENTFLOW_GPU_TEST_DEVICE=cpu pytest -m gpu tests/gpu` runs the same checks on the CPU,
which is how the script itself is checked on a machine without a GPU.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

torch = pytest.importorskip("torch")

from agentflow.inference.base import (  # noqa: E402
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.local import LocalEngine  # noqa: E402
from agentflow.modeling import ModelInit, build_model, score  # noqa: E402

DEVICE = os.environ.get("AGENTFLOW_GPU_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]

INIT = ModelInit(layers=4, hidden=256, heads=8, kv_heads=4, max_context=1024)
TOL = 1e-4


@pytest.fixture
async def engine():
    # fp32 matmuls without TF32, so the 1e-4 bound holds as on CPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = LocalEngine.from_init(INIT, seed=0, device=DEVICE, max_batch_size=64)
    yield eng
    await eng.close()


def req(ids, n, temp=1.0, **kw):
    sp = SamplingParams(temperature=temp, max_new_tokens=n)
    return GenerateRequest(input_ids=tuple(ids), sampling=sp, **kw)


def diff(model, context, res, temp):
    ref = score(model, context + res.output_ids, temp, start=len(context))
    return max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True))


async def test_consistency_and_batching_on_cuda(engine):
    assert str(engine._runner.device).startswith(DEVICE)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 200))] for _ in range(64)]
    lengths = [rng.randrange(1, 64) for _ in range(64)]
    temps = [(0.0, 0.7, 1.0)[i % 3] for i in range(64)]
    results = await asyncio.gather(
        *[engine.generate(req(p, n, t)) for p, n, t in zip(prompts, lengths, temps, strict=True)]
    )
    assert [len(r.output_ids) for r in results] == lengths
    rows = zip(prompts, results, temps, strict=True)
    worst = max(diff(engine.model, p, r, t) for p, r, t in rows)
    assert worst <= TOL, worst


async def test_join_mid_batch_on_cuda(engine):
    long = [asyncio.create_task(engine.generate(req([i + 1] * 9, 300))) for i in range(16)]
    while engine.steps < 5:
        await asyncio.sleep(0.001)
    short = await engine.generate(req([3, 4], 4))
    assert len(short.output_ids) == 4 and not any(t.done() for t in long)
    await asyncio.gather(*long)


async def test_session_reuse_on_cuda(engine):
    sid = await engine.open_session()
    first = await engine.generate(
        req(list(range(50)), 20, 0.0, rid="a", session=SessionRef(session_id=sid))
    )
    child = await engine.generate(
        req([7, 8, 9], 20, 0.0, session=SessionRef(session_id=sid, parent_rid="a"))
    )
    full = list(range(50)) + first.output_ids + [7, 8, 9]
    stateless = await engine.generate(req(full, 20, 0.0))
    assert child.cached_tokens > 0 and child.output_ids == stateless.output_ids
    assert diff(engine.model, full, child, 0.0) <= TOL


async def test_retract_update_resume_on_cuda(engine):
    new_model = build_model(INIT, seed=5)
    tasks = [asyncio.create_task(engine.generate(req([i + 2] * 20, 64))) for i in range(8)]
    while engine.steps < 10:
        await asyncio.sleep(0.001)
    await engine.pause(PauseMode.RETRACT)
    await engine.update_weights(WeightUpdate(state_dict=new_model.state_dict()))
    await engine.resume()
    new_model = new_model.to(DEVICE)
    for i, res in enumerate(await asyncio.gather(*tasks)):
        assert [s.version for s in res.weight_versions] == [0, 1]
        switch = res.weight_versions[1].start
        ctx = [i + 2] * 20
        ref = score(new_model, ctx + res.output_ids, 1.0, start=len(ctx))
        after = zip(ref[switch:], res.logprobs[switch:], strict=True)
        assert max(abs(a - b) for a, b in after) <= TOL

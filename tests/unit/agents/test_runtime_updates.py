"""Weight updates meet running generations in `PolicyRuntime` (partial rollout:
docs/architecture.md, "Asynchrony and staleness")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import GenerateRequest, PauseMode, SamplingParams, WeightUpdate
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit, build_model, score
from agentflow.tokenization.chat import ByteChatTemplate

TINY = ModelInit(layers=1, hidden=32, heads=2, max_context=512)
TOL = 1e-4
PROMPT = [5, 6, 7, 8]


@pytest.fixture
async def engine() -> AsyncIterator[LocalEngine]:
    eng = LocalEngine.from_init(TINY, seed=0, max_batch_size=8)
    yield eng
    await eng.close()


def _request(n: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=tuple(PROMPT), sampling=SamplingParams(temperature=1.0, max_new_tokens=n)
    )


async def _after_steps(engine: LocalEngine, steps: int) -> None:
    async with asyncio.timeout(30):
        while engine.steps < steps:
            await asyncio.sleep(0.001)


def _check_scores(result: object, models: dict[int, object]) -> None:
    """Every token scores as the weights of its version, over the context it was made in."""
    output = result.output_ids  # type: ignore[attr-defined]
    versions = result.token_versions()  # type: ignore[attr-defined]
    scored = {
        v: score(m, PROMPT + output, 1.0, start=len(PROMPT))  # type: ignore[arg-type]
        for v, m in models.items()
    }
    for i, version in enumerate(versions):
        assert abs(scored[version][i] - result.logprobs[i]) <= TOL, (i, version)  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.ABORT])
async def test_a_long_response_survives_two_updates_with_three_version_spans(
    engine: LocalEngine, mode: PauseMode
) -> None:
    runtime = PolicyRuntime(engine, ByteChatTemplate(), interrupt=mode)
    models = {v: build_model(TINY, seed=v) for v in (0, 1, 2)}
    long = asyncio.create_task(runtime.generate(_request(400)))
    await _after_steps(engine, 20)
    await runtime.update_weights(WeightUpdate(state_dict=models[1].state_dict()))
    first_switch = engine.steps
    await _after_steps(engine, first_switch + 20)
    await runtime.update_weights(WeightUpdate(state_dict=models[2].state_dict()))
    result = await long

    assert result.finish_reason == "length" and len(result.output_ids) == 400
    assert [s.version for s in result.weight_versions] == [0, 1, 2]
    assert result.weight_versions[0].start == 0 and result.weight_versions[-1].end == 400
    # Not restarted from scratch: the engine decoded each of the 400 tokens once.
    assert engine.steps <= 400 + 2
    assert runtime.resubmitted == (2 if mode is PauseMode.ABORT else 0)
    _check_scores(result, models)


async def test_without_partial_rollout_an_update_waits_for_running_generations(
    engine: LocalEngine,
) -> None:
    runtime = PolicyRuntime(engine, ByteChatTemplate(), partial_rollout=False)
    running = asyncio.create_task(runtime.generate(_request(200)))
    await _after_steps(engine, 10)
    update = asyncio.create_task(
        runtime.update_weights(WeightUpdate(state_dict=build_model(TINY, seed=1).state_dict()))
    )
    await asyncio.sleep(0.01)
    later = asyncio.create_task(runtime.generate(_request(10)))  # waits for the update
    result = await running
    assert [s.version for s in result.weight_versions] == [0]  # one version per response
    assert await update == 1
    assert [s.version for s in (await later).weight_versions] == [1]


async def test_a_caller_abort_is_not_resubmitted(engine: LocalEngine) -> None:
    runtime = PolicyRuntime(engine, ByteChatTemplate(), interrupt=PauseMode.ABORT)
    request = _request(400)
    task = asyncio.create_task(runtime.generate(request))
    await _after_steps(engine, 5)
    await engine.abort(request.rid)
    result = await task
    assert result.finish_reason == "abort" and runtime.resubmitted == 0

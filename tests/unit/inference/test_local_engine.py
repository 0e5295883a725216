"""LocalEngine: consistency with a teacher-forced forward, sessions, continuous batching,
pause/update/resume, and bad input. Real (tiny) models throughout."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pydantic import ValidationError

from agentflow.errors import EngineError, EngineRequestError, EngineUnavailable
from agentflow.inference.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit, build_model, score

TINY = ModelInit(layers=2, hidden=32, heads=4, kv_heads=2, max_context=192)
TOL = 1e-4


@pytest.fixture
async def engine():
    eng = LocalEngine.from_init(TINY, seed=0, max_batch_size=16)
    yield eng
    await eng.close()


def req(ids, *, temp=1.0, top_p=1.0, n=8, seed=None, stop=(), rid=None, session=None):
    kw = {"rid": rid} if rid else {}
    return GenerateRequest(
        input_ids=tuple(ids),
        sampling=SamplingParams(
            temperature=temp, top_p=top_p, max_new_tokens=n, seed=seed, stop_token_ids=stop
        ),
        session=session,
        **kw,
    )


async def until_steps(engine: LocalEngine, steps: int, timeout: float = 60.0) -> None:
    """Wait until the engine ran `steps` decode steps (fail, never hang)."""
    async with asyncio.timeout(timeout):
        while engine.steps < steps:
            await asyncio.sleep(0.002)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def max_diff(engine: LocalEngine, context: list[int], res: GenerateResult, temp: float) -> float:
    ref = score(engine.model, context + res.output_ids, temp, start=len(context))
    assert len(ref) == len(res.logprobs)
    return max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True))


def test_is_an_engine(engine):
    assert isinstance(engine, Engine)


async def test_logprobs_match_teacher_forcing_in_any_batch(engine):
    rng = random.Random(0)
    temps = [1.0, 0.0, 0.7, 1.3]
    prompts = [prompt(rng, rng.randrange(1, 40)) for _ in range(12)]
    # Alone, then all together (mixed lengths, temperatures, top-p), then in a full batch.
    alone = [await engine.generate(req(prompts[0], temp=0.7, n=6))]
    mixed = await asyncio.gather(
        *[
            engine.generate(req(p, temp=temps[i % 4], top_p=0.9 if i % 3 else 1.0, n=4 + i))
            for i, p in enumerate(prompts)
        ]
    )
    assert max_diff(engine, prompts[0], alone[0], 0.7) <= TOL
    for i, (p, res) in enumerate(zip(prompts, mixed, strict=True)):
        assert res.finish_reason == "length" and len(res.output_ids) == 4 + i
        assert res.prompt_tokens == len(p)
        assert max_diff(engine, p, res, temps[i % 4]) <= TOL


async def assert_batch_consistent(eng: LocalEngine, seed: int, temp: float) -> None:
    """A batch of mixed-length prompts scores as teacher forcing; closes `eng`."""
    try:
        rng = random.Random(seed)
        prompts = [prompt(rng, rng.randrange(1, 30)) for _ in range(6)]
        results = await asyncio.gather(*[eng.generate(req(p, n=7, temp=temp)) for p in prompts])
        for p, res in zip(prompts, results, strict=True):
            assert max_diff(eng, p, res, temp) <= TOL
    finally:
        await eng.close()


async def test_generic_hf_path_is_consistent_too():
    # No Llama fast path, no bursts: the model's own forward over the slot cache.
    eng = LocalEngine.from_init(TINY, seed=2, fast_decode=False, decode_burst=1)
    await assert_batch_consistent(eng, seed=2, temp=0.9)


# A tiny HF model shape for the fast path's architecture variants.
TINY_HF = dict(
    vocab_size=266,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=192,
)


def _tiny_hf_model(kind: str, seed: int, **config: object):
    """A random `TINY_HF` model of `kind` (`llama` or `qwen2`), its config extended."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "qwen2":
            return Qwen2ForCausalLM(Qwen2Config(**TINY_HF, **config)).eval()
        return LlamaForCausalLM(LlamaConfig(**TINY_HF, **config)).eval()


def _biased_model(kind: str):
    """A tiny random model whose projections carry biases (the fast step's other branch)."""
    import torch

    if kind == "qwen2":  # q/k/v biases, as in every Qwen2 checkpoint
        model = _tiny_hf_model("qwen2", 3, use_sliding_window=False)
    else:
        model = _tiny_hf_model("llama", 3, attention_bias=True, mlp_bias=True)
    draws = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5, generator=draws)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama-bias"])
async def test_fast_step_with_biases_is_consistent(kind):
    from agentflow.inference import fast_decode

    model = _biased_model(kind)
    assert fast_decode.supports(model)
    eng = LocalEngine(model, max_batch_size=8)
    assert eng._runner._fast is not None
    await assert_batch_consistent(eng, seed=4, temp=0.8)


SCALED_ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("rope", sorted(SCALED_ROPE))
async def test_fast_path_with_scaled_rope_is_consistent(rope):
    """Position-only rope scalings go through the cached rotary table: prompts past the
    llama3 original length still score as teacher forcing."""
    rope_parameters = {**SCALED_ROPE[rope], "rope_theta": 10000.0}
    model = _tiny_hf_model("llama", 5, rope_parameters=rope_parameters)
    eng = LocalEngine(model, max_batch_size=8)
    assert eng._runner._fast is not None and eng._runner._fast._static_rope
    await assert_batch_consistent(eng, seed=5, temp=1.0)


async def test_seed_reproduces_sampling(engine):
    a = await engine.generate(req([5, 6, 7], seed=123, n=12))
    b = await engine.generate(req([5, 6, 7], seed=123, n=12))
    assert a.output_ids == b.output_ids


async def test_session_reuses_kv_and_matches_stateless(engine):
    sid = await engine.open_session()
    context: list[int] = []
    parent = None
    for turn in range(3):
        new = [10 + turn, 11, 12] if turn else [1, 2, 3, 4, 5, 6, 7]
        session = SessionRef(session_id=sid, parent_rid=parent)
        res = await engine.generate(req(new, temp=0, n=6, rid=f"t{turn}", session=session))
        context = context + new
        stateless = await engine.generate(req(context, temp=0, n=6))
        assert res.output_ids == stateless.output_ids
        assert res.prompt_tokens == len(context)
        assert max_diff(engine, context, res, 0.0) <= TOL
        if turn:
            # All of the parent's context but its last sampled token had KV.
            assert res.cached_tokens == len(context) - len(new) - 1
        assert stateless.cached_tokens == 0
        context = context + res.output_ids
        parent = f"t{turn}"


async def test_offset_truncates_the_parent(engine):
    sid = await engine.open_session()
    first = await engine.generate(
        req([1, 2, 3, 4, 5], temp=0, n=5, rid="p", session=SessionRef(session_id=sid))
    )
    child = await engine.generate(
        req([9], temp=0, n=4, session=SessionRef(session_id=sid, parent_rid="p", offset=3))
    )
    stateless = await engine.generate(req([1, 2, 3, 9], temp=0, n=4))
    assert child.output_ids == stateless.output_ids
    assert child.prompt_tokens == 4 and child.cached_tokens == 3
    assert first.output_ids


async def test_evicted_session_kv_is_recomputed():
    eng = LocalEngine.from_init(TINY, seed=0, kv_budget_tokens=40)
    try:
        sid = await eng.open_session()
        ctx = list(range(30, 60))
        first = await eng.generate(req(ctx, n=5, rid="a", session=SessionRef(session_id=sid)))
        # A second, unrelated session request of 35 tokens pushes "a" out of the budget.
        await eng.generate(req(list(range(35)), n=1, rid="b", session=SessionRef(session_id=sid)))
        child = await eng.generate(
            req([7, 8], temp=0.5, n=5, session=SessionRef(session_id=sid, parent_rid="a"))
        )
        full = ctx + first.output_ids + [7, 8]
        assert child.cached_tokens == 0
        assert max_diff(eng, full, child, 0.5) <= TOL
        assert (await eng.info()).extra["kv_evictions"] >= 1
    finally:
        await eng.close()


async def test_64_concurrent_mixed_requests_complete():
    eng = LocalEngine.from_init(TINY, seed=1, max_batch_size=64)
    try:
        rng = random.Random(1)
        prompts = [prompt(rng, rng.randrange(1, 60)) for _ in range(64)]
        lengths = [rng.randrange(1, 24) for _ in range(64)]
        results = await asyncio.gather(
            *[eng.generate(req(p, n=n, temp=0.8)) for p, n in zip(prompts, lengths, strict=True)]
        )
        assert [len(r.output_ids) for r in results] == lengths
        assert all(r.weight_versions[0].version == 0 for r in results)
        for i in (0, 17, 63):
            assert max_diff(eng, prompts[i], results[i], 0.8) <= TOL
        assert (await eng.info()).running == 0
    finally:
        await eng.close()


async def test_request_joins_a_running_batch(engine):
    long = [asyncio.create_task(engine.generate(req([i + 1] * 5, n=80))) for i in range(6)]
    await until_steps(engine, 5)
    short = await engine.generate(req([3, 4], n=3))
    assert len(short.output_ids) == 3
    # The batch had not drained: the long requests were still running when it finished.
    assert not any(t.done() for t in long)
    assert all(len(r.output_ids) == 80 for r in await asyncio.gather(*long))


async def test_retract_update_resume_switches_versions(engine):
    new_model = build_model(TINY, seed=7)
    prompts = [[i + 2] * (3 + i) for i in range(5)]
    tasks = [asyncio.create_task(engine.generate(req(p, n=40))) for p in prompts]
    await until_steps(engine, 8)
    await engine.pause(PauseMode.RETRACT)
    version = await engine.update_weights(WeightUpdate(state_dict=new_model.state_dict()))
    assert version == 1
    await engine.resume()
    results = await asyncio.gather(*tasks)
    old_model = build_model(TINY, seed=0)
    for p, res in zip(prompts, results, strict=True):
        assert res.finish_reason == "length" and len(res.output_ids) == 40
        assert [s.version for s in res.weight_versions] == [0, 1]
        versions = res.token_versions()
        old = score(old_model, p + res.output_ids, 1.0, start=len(p))
        new = score(new_model, p + res.output_ids, 1.0, start=len(p))
        for i, v in enumerate(versions):
            ref = new if v == 1 else old
            assert abs(ref[i] - res.logprobs[i]) <= TOL, (i, v)


async def test_pause_abort_ends_requests_with_partial_output(engine):
    tasks = [asyncio.create_task(engine.generate(req([9, 9, 9], n=150))) for _ in range(3)]
    await until_steps(engine, 3)
    await engine.pause(PauseMode.ABORT)
    results = await asyncio.gather(*tasks)
    assert all(r.finish_reason == "abort" and 0 < len(r.output_ids) < 150 for r in results)
    queued = asyncio.create_task(engine.generate(req([1], n=2)))
    await asyncio.sleep(0.05)
    assert not queued.done()  # paused: new requests wait for resume
    await engine.resume()
    assert len((await queued).output_ids) == 2


async def test_pause_in_place_keeps_requests(engine):
    task = asyncio.create_task(engine.generate(req([4, 5], n=30)))
    await until_steps(engine, 3)
    await engine.pause(PauseMode.IN_PLACE)
    steps = engine.steps
    await asyncio.sleep(0.05)
    assert engine.steps == steps and not task.done()
    await engine.resume()
    res = await task
    assert res.finish_reason == "length" and len(res.output_ids) == 30
    assert max_diff(engine, [4, 5], res, 1.0) <= TOL


async def test_abort_one_request(engine):
    victim = asyncio.create_task(engine.generate(req([1, 2], n=150, rid="victim")))
    other = asyncio.create_task(engine.generate(req([3, 4], n=20)))
    await until_steps(engine, 2)
    await engine.abort("victim")
    assert (await victim).finish_reason == "abort"
    assert len((await other).output_ids) == 20


async def test_stop_token_ends_generation(engine):
    greedy = await engine.generate(req([1, 2, 3], temp=0, n=5))
    stop = greedy.output_ids[2]
    first = greedy.output_ids.index(stop)
    res = await engine.generate(req([1, 2, 3], temp=0, n=5, stop=(stop,)))
    assert res.finish_reason == "stop"
    assert res.output_ids == greedy.output_ids[: first + 1]


async def test_update_weights_from_safetensors_dir(engine, tmp_path):
    from agentflow.modeling import save_model

    new_model = build_model(TINY, seed=3)
    save_model(new_model, tmp_path)
    assert await engine.update_weights(WeightUpdate(path=str(tmp_path), version=5)) == 5
    res = await engine.generate(req([1, 2, 3], n=6))
    assert res.weight_versions[0].version == 5
    ref = score(new_model, [1, 2, 3] + res.output_ids, 1.0, start=3)
    assert max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True)) <= TOL


async def test_bad_weights_are_refused_and_old_ones_kept(engine):
    good = engine.score([1, 2, 3, 4])
    sd = build_model(TINY, seed=3).state_dict()
    sd["model.norm.weight"] = sd["model.norm.weight"][:-1]
    with pytest.raises(EngineRequestError, match="shape"):
        await engine.update_weights(WeightUpdate(state_dict=sd))
    with pytest.raises(EngineRequestError, match="unknown"):
        await engine.update_weights(WeightUpdate(state_dict={"nope": sd["model.norm.weight"]}))
    with pytest.raises(EngineRequestError, match="not newer"):
        await engine.update_weights(WeightUpdate(state_dict=sd, version=0))
    assert engine.score([1, 2, 3, 4]) == good
    assert (await engine.info()).weight_version == 0


async def test_bad_input_fails_that_request_only(engine):
    sid = await engine.open_session()
    good = asyncio.create_task(engine.generate(req([1, 2, 3], n=20)))
    bad = [
        (req([]), "empty"),
        (req([1, 5000]), "outside the vocabulary"),
        (req([-1]), "outside the vocabulary"),
        (req([1] * 150, n=50), "exceeds the context length"),
        (req([1], session=SessionRef(session_id="nope")), "unknown session"),
        (req([1], session=SessionRef(session_id=sid, parent_rid="ghost")), "unknown parent"),
    ]
    for r, message in bad:
        with pytest.raises(EngineRequestError, match=message):
            await engine.generate(r)
    zero = GenerateRequest.model_construct(
        input_ids=(1,),
        sampling=SamplingParams.model_construct(
            temperature=1.0, top_p=1.0, max_new_tokens=0, stop_token_ids=(), seed=None
        ),
        rid="z",
        session=None,
        routing_key=None,
    )
    with pytest.raises(EngineRequestError, match="max_new_tokens"):
        await engine.generate(zero)
    with pytest.raises(ValidationError):
        SamplingParams(max_new_tokens=0)
    assert len((await good).output_ids) == 20


async def test_a_failed_step_fails_its_requests_only(engine, monkeypatch):
    real_step = engine._runner.step
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_step(plan)

    monkeypatch.setattr(engine._runner, "step", flaky)
    with pytest.raises(EngineError, match="simulated device fault"):
        await engine.generate(req([1, 2], n=3))
    assert len((await engine.generate(req([1, 2], n=3))).output_ids) == 3


async def test_closed_engine_refuses(engine):
    await engine.close()
    with pytest.raises(EngineUnavailable):
        await engine.generate(req([1]))


async def test_from_pretrained_serves_a_saved_checkpoint(tmp_path):
    from agentflow.modeling import save_model

    model = build_model(TINY, seed=4)
    save_model(model, tmp_path / "ckpt")
    eng = LocalEngine.from_pretrained(tmp_path / "ckpt", max_batch_size=4)
    try:
        info = await eng.info()
        assert info.model == "ckpt" and info.max_context == TINY.max_context
        res = await eng.generate(req([1, 2, 3], n=5, temp=0.8))
        ref = score(model, [1, 2, 3] + res.output_ids, 0.8, start=3)
        assert max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True)) <= TOL
    finally:
        await eng.close()


async def test_a_request_that_waits_for_a_slot_reports_how_long() -> None:
    """`queue_s`: the wait for a decode slot before the request first ran."""
    one_slot = LocalEngine.from_init(TINY, seed=0, max_batch_size=1)
    try:
        first = asyncio.create_task(one_slot.generate(req([9, 9], n=150)))
        ended: list[float] = []
        first.add_done_callback(lambda _: ended.append(time.perf_counter()))
        await until_steps(one_slot, 2)
        submitted = time.perf_counter()
        second = await one_slot.generate(req([1], n=2))  # waits for the first to end
        ran_first = await first
        assert len(ran_first.output_ids) == 150 and ran_first.queue_s < second.queue_s
        # It waited out the first's remaining steps (the callback that timed them runs a
        # little after the first ends, so at least half of it).
        assert second.queue_s >= 0.5 * (ended[0] - submitted) > 0
    finally:
        await one_slot.close()

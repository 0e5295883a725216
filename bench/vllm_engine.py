"""vLLM as the run's engine, measured: training-inference mismatch, weight updates,
serving. Each part runs its baseline beside the candidate in this one process.

    python -m bench.vllm_engine mismatch [--checkpoint DIR]
    python -m bench.vllm_engine updates  [--checkpoint DIR] [--big]
    python -m bench.vllm_engine serving  [--checkpoint DIR]

- mismatch: each engine samples 64 answers of 64 tokens (temperature 1) to the same
  prompts; the trainer (torch, float32) scores each answer; per token,
  |log-prob(engine) - log-prob(trainer)|: mean, p99, max, and the share of tokens whose
  ratio exp(trainer - engine) leaves [0.5, 2], then the share `tis_cap = 2` truncates
  (the ratio above 2). Engines: vLLM float32, vLLM bfloat16, the local engine.
- updates: pause -> reload -> version -> resume, 20 times, with 8 answers running
  (`keep`: they wait in the server; `abort`: they end and are sent again), p50 and p99;
  `--big` also at about 100M parameters (12 x 768).
- serving: decode tokens/s at batch 32 (128 tokens each, no early stop) on vLLM and on
  the local engine, the same checkpoint; and the prefix-cache hit rate (cached / prompt
  tokens) of 8 ten-turn episodes on two servers, with session affinity (one pool) and
  without (each turn to the other server).

`--checkpoint` defaults to the vLLM quickstart's warm start (runs/quickstart-vllm/sft)
when it is there, else a fresh model of the quickstart's shape. Needs `.venv-vllm`
(`agentflow engine install-vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.base import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.pool import EnginePool
from agentflow.inference.vllm import VLLMEngine, VLLMSettings
from agentflow.inference.vllm_server import VLLMServer
from agentflow.run_config import VLLMLaunchConfig
from agentflow.tokenization.chat import ByteChatTemplate

QUICKSTART = {"layers": 2, "hidden": 128, "heads": 4, "max_context": 512}
BIG = {"layers": 12, "hidden": 768, "heads": 12, "max_context": 512}
TEMPLATE = ByteChatTemplate()


def checkpoint(path: str | None, scratch: Path, shape: dict[str, int], seed: int = 0) -> Path:
    """The checkpoint to serve, its output head untied as AgentFlow serves it on vLLM
    (agentflow/inference/vllm_checkpoint.py: a tied head goes stale on reload)."""
    from agentflow.inference.vllm_checkpoint import is_tied, untie_head
    from agentflow.modeling import ModelInit, build_model, save_model

    default = Path("runs/quickstart-vllm/sft")
    if path:
        model = Path(path)
    elif shape is QUICKSTART and seed == 0 and (default / "config.json").is_file():
        model = default
    else:
        model = save_model(
            build_model(ModelInit(**shape), seed=seed), scratch / f"m{seed}-{shape['layers']}"
        )
    if not is_tied(model):
        return model
    return untie_head(model, scratch / f"untied-{seed}-{shape['layers']}")


def server(model: Path, dtype: str = "float32", kv_gib: int = 1) -> VLLMServer:
    launch = VLLMLaunchConfig(dtype=dtype, max_model_len=512, kv_cache_gib=kv_gib)  # type: ignore[arg-type]
    started = VLLMServer(launch, str(model))
    started.start()
    return started


def client(url: str, reference: Path | None = None) -> VLLMEngine:
    return VLLMEngine(
        VLLMSettings(url=url, reference_checkpoint=str(reference) if reference else None)
    )


def prompts(n: int, length: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    words = ["guess", "number", "higher", "lower", "found", "between", "1", "16", "turn"]
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(length))[: length * 2]
        out.append((TEMPLATE.tokenizer.bos_id, *TEMPLATE.tokenizer.encode(text)[: length - 1]))
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]


# ---- mismatch -----------------------------------------------------------------------


async def sample_all(engine, asks: list[tuple[int, ...]]) -> list[GenerateResult]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64, seed=None)
    return list(
        await asyncio.gather(
            *(engine.generate(GenerateRequest(input_ids=p, sampling=sampling)) for p in asks)
        )
    )


def mismatch_row(name: str, model, asks, results: list[GenerateResult]) -> str:
    from agentflow.modeling import score

    diffs, outside, truncated = [], 0, 0
    for ask, result in zip(asks, results, strict=True):
        ours = score(model, [*ask, *result.output_ids], 1.0, start=len(ask))
        for trainer, engine in zip(ours, result.logprobs, strict=True):
            diffs.append(abs(trainer - engine))
            ratio = math.exp(trainer - engine)
            outside += not 0.5 <= ratio <= 2.0
            truncated += ratio > 2.0
    n = len(diffs)
    return (
        f"| {name} | {n} | {statistics.fmean(diffs):.2e} | {pct(diffs, 0.99):.2e} | "
        f"{max(diffs):.2e} | {outside / n:.4%} | {truncated / n:.4%} |"
    )


async def mismatch(args: argparse.Namespace, scratch: Path) -> None:
    from agentflow.inference.local import LocalEngine
    from agentflow.modeling import load_model

    model_dir = checkpoint(args.checkpoint, scratch, QUICKSTART)
    trainer = load_model(model_dir)
    asks = prompts(64, 48)
    print(f"checkpoint {model_dir}; 64 answers x 64 tokens, temperature 1")
    print("| engine | tokens | mean abs diff | p99 | max | ratio outside [0.5, 2] | > tis_cap 2 |")
    print("|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        started = server(model_dir, dtype)
        engine = client(started.url)
        try:
            results = await sample_all(engine, asks)
        finally:
            await engine.close()
            started.stop()
        print(mismatch_row(f"vLLM {dtype}", trainer, asks, results), flush=True)
    local = LocalEngine.from_pretrained(str(model_dir))
    try:
        results = await sample_all(local, asks)
    finally:
        await local.close()
    print(mismatch_row("local engine", trainer, asks, results), flush=True)


# ---- weight updates -------------------------------------------------------------------


async def updates_at(model_dir: Path, other: Path, label: str) -> None:
    started = server(model_dir, kv_gib=2)
    engine = client(started.url, reference=model_dir)
    try:
        for mode in (PauseMode.RETRACT, PauseMode.ABORT):
            runtime = PolicyRuntime(
                engine=engine,
                template=TEMPLATE,
                sampling=SamplingParams(max_new_tokens=400),
                max_context=512,
                interrupt=mode,
            )
            version = await engine.current_version()
            running = [
                asyncio.create_task(
                    runtime.generate(
                        GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=400))
                    )
                )
                for p in prompts(8, 16, seed=1)
            ]
            times = []
            for k in range(20):
                await asyncio.sleep(0.05)
                version += 1
                path = other if k % 2 == 0 else model_dir
                t0 = time.perf_counter()
                await runtime.update_weights(WeightUpdate(path=str(path), version=version))
                times.append(time.perf_counter() - t0)
            results = await asyncio.gather(*running)
            split = sum(len(r.weight_versions) > 1 for r in results)
            name = "keep" if mode is PauseMode.RETRACT else "abort"
            print(
                f"| {label} | {name} | {pct(times, 0.5) * 1000:.0f} ms | "
                f"{pct(times, 0.99) * 1000:.0f} ms | {split}/8 answers span several versions, "
                f"{runtime.resubmitted} resubmitted |",
                flush=True,
            )
    finally:
        await engine.close()
        started.stop()


async def updates(args: argparse.Namespace, scratch: Path) -> None:
    print("| model | pause mode | p50 | p99 | answers in flight |")
    print("|---|---|---|---|---|")
    model_dir = checkpoint(args.checkpoint, scratch, QUICKSTART)
    other = checkpoint(None, scratch, QUICKSTART, seed=1)
    await updates_at(model_dir, other, "quickstart (0.6M)")
    if args.big:
        big, big_other = checkpoint(None, scratch, BIG), checkpoint(None, scratch, BIG, seed=1)
        await updates_at(big, big_other, "12 x 768 (85M)")


# ---- serving --------------------------------------------------------------------------


async def decode_rate(engine, n: int = 32, new: int = 128) -> float:
    asks = prompts(n, 32, seed=2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    await engine.generate(GenerateRequest(input_ids=asks[0], sampling=sampling))  # warm
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(engine.generate(GenerateRequest(input_ids=p, sampling=sampling)) for p in asks)
    )
    elapsed = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in results) / elapsed


async def episodes(send, n: int = 8, turns: int = 10) -> float:
    """`send(episode, turn, context, session state)` plays one turn; cached / prompt."""
    cached = prompt = 0
    rng = random.Random(3)
    for episode in range(n):
        context: tuple[int, ...] = prompts(1, 100, seed=10 + episode)[0]
        state: dict[str, object] = {}
        for turn in range(turns):
            result = await send(episode, turn, context, state)
            cached += result.cached_tokens
            prompt += result.prompt_tokens
            observation = tuple(rng.randrange(32, 127) for _ in range(20))
            context = (*context, *result.output_ids, *observation)
            state["observation"] = observation
    return cached / prompt


async def serving(args: argparse.Namespace, scratch: Path) -> None:
    from agentflow.inference.local import LocalEngine

    model_dir = checkpoint(args.checkpoint, scratch, QUICKSTART)
    servers = [server(model_dir), server(model_dir)]
    engines = [client(s.url) for s in servers]
    try:
        vllm_rate = await decode_rate(engines[0])
        local = LocalEngine.from_pretrained(str(model_dir))
        try:
            local_rate = await decode_rate(local)
        finally:
            await local.close()
        print(
            f"decode at batch 32: vLLM {vllm_rate:.0f} tokens/s, local engine "
            f"{local_rate:.0f} tokens/s, ratio {vllm_rate / local_rate:.2f}"
        )

        pool = EnginePool(engines)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=16)

        async def affine(episode: int, turn: int, context, state) -> GenerateResult:
            if turn == 0:
                state["session"] = await pool.open_session()
                ask = GenerateRequest(
                    input_ids=context,
                    sampling=sampling,
                    session=SessionRef(session_id=str(state["session"])),
                )
            else:
                ask = GenerateRequest(
                    input_ids=state["observation"],
                    sampling=sampling,  # type: ignore[arg-type]
                    session=SessionRef(
                        session_id=str(state["session"]), parent_rid=str(state["rid"])
                    ),
                )
            result = await pool.generate(ask)
            state["rid"] = result.rid
            return result

        async def scattered(episode: int, turn: int, context, state) -> GenerateResult:
            engine = engines[(episode + turn) % 2]
            return await engine.generate(GenerateRequest(input_ids=context, sampling=sampling))

        with_affinity = await episodes(affine)
        for engine in engines:
            await engine._call("POST", "/reset_prefix_cache")
        without = await episodes(scattered)
        print(
            f"prefix-cache hit rate, 8 episodes x 10 turns on 2 servers: with session "
            f"affinity {with_affinity:.1%}, each turn to the other server {without:.1%}"
        )
    finally:
        for engine in engines:
            await engine.close()
        for started in servers:
            started.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["mismatch", "updates", "serving"])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--big", action="store_true", help="updates: also at about 100M")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        part = {"mismatch": mismatch, "updates": updates, "serving": serving}[args.part]
        asyncio.run(part(args, Path(scratch)))


if __name__ == "__main__":
    main()

"""LocalEngine against transformers' `generate`, and session KV reuse against stateless turns.

Both comparisons run in this one process on the same model, batch and lengths, and print
ratios (machine speed varies between runs; ratios measured side by side do not):

1. decode throughput: `LocalEngine` (continuous batching, slot KV) vs `model.generate`
   (DynamicCache, sampling, per-step scores kept as the engine keeps log-probs), batch 32,
   same prompts, every sequence forced to the full length. Target: >= 1.5x.
2. prefill cost of a 10-turn session: each turn appends an assistant reply and an env
   observation. With KV reuse a turn names its parent rid and computes only the new
   tokens; the stateless equivalent sends the whole context each turn. Each turn samples
   one token so the time is the prefill. Target: <= 30% of the stateless cost.
3. prefill path: the engine's own lean layers vs the model's HF forward (the generic
   path), on the same engine settings: a batch of prompts sampling one token each, and
   the 10-turn session with KV reuse.

    python bench/engine.py [--threads N] [--layers 4 --hidden 128] [--batch 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from agentflow.inference.base import GenerateRequest, SamplingParams, SessionRef
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit, build_model


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.config.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    elapsed = time.perf_counter() - t0
    assert out.sequences.shape[1] == len(prompts[0]) + new_tokens
    return elapsed


async def engine_generate(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> float:
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[engine.generate(GenerateRequest(input_ids=tuple(p), sampling=sp)) for p in prompts]
    )
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_ids) == new_tokens for r in results)
    return elapsed


async def session_turns(
    engine: LocalEngine, turns: list[list[int]], reuse: bool
) -> tuple[float, int]:
    """Seconds and tokens prefilled for the turns; `turns[k]` is what turn k appends."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    sid = await engine.open_session()
    context: list[int] = []
    computed = 0
    elapsed = 0.0
    for k, new in enumerate(turns):
        if reuse:
            session = SessionRef(
                session_id=sid,
                parent_rid=f"{sid}-{k - 1}" if k else None,
                offset=len(context) if k else None,  # drop the one sampled token
            )
            req = GenerateRequest(
                input_ids=tuple(new), sampling=sp, rid=f"{sid}-{k}", session=session
            )
        else:
            req = GenerateRequest(input_ids=tuple(context + new), sampling=sp)
        t0 = time.perf_counter()
        res = await engine.generate(req)
        elapsed += time.perf_counter() - t0
        computed += res.prompt_tokens - res.cached_tokens
        context += new
        assert res.prompt_tokens == len(context)
    await engine.close_session(sid)
    return elapsed, computed


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    init = ModelInit(layers=args.layers, hidden=args.hidden, heads=4, max_context=2048)
    model = build_model(init, seed=0)
    engine = LocalEngine(build_model(init, seed=0), max_batch_size=128, max_context=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(args.batch)]
    n_tokens = args.batch * args.new
    print(f"model {args.layers} layers x {args.hidden} hidden, torch threads {args.threads}")

    # Warm up both paths once, then alternate so drift in machine load hits both alike.
    hf_generate(model, prompts[:2], 4)
    await engine_generate(engine, prompts[:2], 4)
    hf_times, eng_times = [], []
    for _ in range(args.repeats):
        hf_times.append(hf_generate(model, prompts, args.new))
        eng_times.append(await engine_generate(engine, prompts, args.new))
    hf_tps, eng_tps = n_tokens / min(hf_times), n_tokens / min(eng_times)
    print(f"decode batch {args.batch}, prompt {args.prompt}, {args.new} new tokens each")
    print(f"  transformers generate : {hf_tps:9.0f} tokens/s")
    print(f"  LocalEngine           : {eng_tps:9.0f} tokens/s")
    print(f"  ratio engine/generate : {eng_tps / hf_tps:9.2f}x   (target >= 1.5x)")

    for batch in (64, 128):
        wide = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(batch)]
        t = await engine_generate(engine, wide, args.new)
        print(f"  LocalEngine batch {batch:3d} : {batch * args.new / t:9.0f} tokens/s")

    # 10 turns: a 200-token prompt, then a 24-token reply + 40-token observation per turn.
    turns = [[rng.randrange(256) for _ in range(200)]]
    turns += [[rng.randrange(256) for _ in range(64)] for _ in range(9)]
    await session_turns(engine, turns[:2], reuse=True)  # warm-up
    stateless_s, stateless_tok = await session_turns(engine, turns, reuse=False)
    reuse_s, reuse_tok = await session_turns(engine, turns, reuse=True)
    print("10-turn session prefill (one sampled token per turn)")
    print(f"  stateless : {stateless_tok:6d} tokens computed, {stateless_s * 1000:8.1f} ms")
    print(f"  KV reuse  : {reuse_tok:6d} tokens computed, {reuse_s * 1000:8.1f} ms")
    print(
        f"  ratio reuse/stateless : tokens {reuse_tok / stateless_tok:.1%}, "
        f"time {reuse_s / stateless_s:.1%}   (target <= 30%)"
    )

    generic = LocalEngine(
        build_model(init, seed=0), max_batch_size=128, max_context=2048, fast_prefill=False
    )
    await engine_generate(generic, prompts[:2], 1)
    await session_turns(generic, turns[:2], reuse=True)
    batch_s: dict[str, list[float]] = {"fast": [], "hf": []}
    session_s: dict[str, list[float]] = {"fast": [], "hf": []}
    for _ in range(args.repeats):
        for name, eng in (("hf", generic), ("fast", engine)):
            batch_s[name].append(await engine_generate(eng, prompts, 1))
            session_s[name].append((await session_turns(eng, turns, reuse=True))[0])
    print("prefill: lean layers vs the HF forward")
    for label, times in (
        (f"batch {args.batch} x {args.prompt} tokens", batch_s),
        ("10-turn session, KV reuse", session_s),
    ):
        hf, fast = min(times["hf"]), min(times["fast"])
        print(
            f"  {label:26s}: HF {hf * 1000:7.1f} ms, lean {fast * 1000:7.1f} ms, "
            f"ratio {hf / fast:.2f}x"
        )
    await generic.close()
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())

"""How many distinct tasks an optimizer step sees, against how fast on-policy distillation
leaves its plateau (docs/distillation.md, "Every optimizer step sees every task").

Outside the train loop, so nothing but the data of a step differs: a fresh student (the
examples' 2 layers x 128) answers the first question of shift and mirror episodes
(`shift 482` -> `593`), sampling its own answers at temperature 1; the loss is the exact
reverse KL to the teacher of each question's skill (`trainer.algorithms.reverse_kl`, what
`estimator = "full"` trains); AdamW, the same seed, lr and batch size for every setting. The
settings differ only in how many *distinct* questions per skill fill a step's batch (the
rest repeat them): a batch cut in order out of groups of 8 gives a step 2 or 3, dealt
round-robin it gives one per group. Printed: sampled accuracy per skill every 50 steps,
the first step each setting reaches 50% and 90% on both skills, and the ratio.

Train the two teachers first (examples/distill/teacher-*.toml), then:

    python -m bench.distill_tasks_per_step [--distinct 24 3] [--steps 600]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from agentflow.modeling import ModelInit, build_model, load_model
from agentflow.tokenization.bytes import ByteTokenizer
from agentflow.tokenization.chat import ChatTemplate, chat_template_for
from envs.builtin.digits import SKILLS, solve
from trainer.algorithms import reverse_kl

TEACHERS = "runs/teacher-{skill}/checkpoints/step-00000080/model"
ANSWER_TOKENS = 4  # three digits and the end of the turn


def prompt(template: ChatTemplate, skill: str, digits: str) -> list[int]:
    """The first turn as the white-box agent renders it."""
    return list(template.render([{"role": "user", "content": f"{skill} {digits}"}]).token_ids)


def sample(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(ANSWER_TOKENS):
            logits = model(ids).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
    return ids


def questions(rng: random.Random, skill: str, n: int, distinct: int) -> list[tuple[str, str]]:
    fresh = [(skill, "".join(rng.choice("0123456789") for _ in range(3))) for _ in range(distinct)]
    return [fresh[i % distinct] for i in range(n)]


def accuracy(
    model: Any, template: ChatTemplate, rng: random.Random, n: int = 400
) -> dict[str, float]:
    """Sampled (T=1): the three digits right and the turn ended after them."""
    out: dict[str, float] = {}
    for skill in SKILLS:
        qs = questions(rng, skill, n, n)
        ids = sample(model, [prompt(template, *q) for q in qs])
        start = ids.shape[1] - ANSWER_TOKENS
        right = 0
        for (_, digits), row in zip(qs, ids.tolist(), strict=True):
            answer = bytes(t for t in row[start : start + 3] if t < 256).decode(errors="replace")
            right += answer == solve(skill, digits) and row[start + 3] in template.stop_ids
        out[skill] = right / n
    return out


Curve = list[tuple[int, dict[str, float]]]  # (step, sampled accuracy per skill)


def run(distinct: int, args: argparse.Namespace, teachers: dict[str, Any]) -> Curve:
    template = chat_template_for(ByteTokenizer())
    torch.manual_seed(args.seed)
    rng, eval_rng = random.Random(args.seed), random.Random(10_000 + args.seed)
    init = ModelInit(layers=2, hidden=128, heads=args.heads, max_context=256)
    student = build_model(init, seed=args.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    curve = []
    started = time.perf_counter()
    for step in range(args.steps + 1):
        if step % 50 == 0 or step == args.steps:
            student.eval()
            acc = accuracy(student, template, eval_rng)
            curve.append((step, acc))
            print(
                f"  distinct {distinct:3d}  step {step:4d}  shift {acc['shift']:.2f}  "
                f"mirror {acc['mirror']:.2f}  ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            student.train()
        if step == args.steps:
            break
        loss = torch.zeros(())
        for skill in SKILLS:
            qs = questions(rng, skill, args.batch // 2, distinct)
            student.eval()
            ids = sample(student, [prompt(template, *q) for q in qs])
            student.train()
            at = slice(ids.shape[1] - ANSWER_TOKENS - 1, None)  # the positions predicting answers
            logp = torch.log_softmax(student(ids[:, :-1]).logits[:, at].float(), -1)
            with torch.no_grad():
                teacher_logp = torch.log_softmax(teachers[skill](ids[:, :-1]).logits[:, at], -1)
            loss = loss + reverse_kl(logp, teacher_logp).mean() / len(SKILLS)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
    return curve


def first(curve: Curve, level: float) -> int | None:
    return next((step for step, acc in curve if min(acc.values()) >= level), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distinct", type=int, nargs="+", default=[24, 3])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=48, help="first questions per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teachers", default=TEACHERS, help="path with {skill} in it")
    args = parser.parse_args()
    if not all(1 <= distinct <= args.batch // 2 for distinct in args.distinct):
        raise SystemExit(f"--distinct: each must be in [1, {args.batch // 2}] (half the batch)")
    torch.set_num_threads(2)
    teachers: dict[str, Any] = {}
    for skill in SKILLS:
        path = Path(args.teachers.format(skill=skill))
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"no teacher at {path}: agentflow train examples/distill/teacher-{skill}.toml"
            )
        teachers[skill] = load_model(path).eval()
    results = {}
    for distinct in args.distinct:
        print(f"{distinct} distinct questions per skill per step", flush=True)
        results[distinct] = run(distinct, args, teachers)
    print("\ndistinct per skill | first step >= 50% both | first step >= 90% both")
    for distinct, curve in results.items():
        print(f"{distinct:18d} | {first(curve, 0.5)!s:>22} | {first(curve, 0.9)!s:>22}")
    base = args.distinct[0]
    for distinct in args.distinct[1:]:
        a, b = first(results[base], 0.9), first(results[distinct], 0.9)
        if a and b:
            print(f"steps to 90%: {distinct} distinct / {base} distinct = {b / a:.1f}x")
        elif a:
            print(f"{distinct} distinct: not at 90% within {args.steps} steps ({base}: step {a})")


if __name__ == "__main__":
    main()

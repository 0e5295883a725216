"""Per-exec overhead of the bubblewrap sandbox against a bare subprocess, in the same run.

Both sides go through the same spawn-and-capture code (``sandbox.process.run_captured``),
so the difference is what bwrap adds: namespaces, mounts, the cgroup join, rlimits.

    python bench/sandbox_exec.py --n 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import ExecStatus, SandboxLimits  # noqa: E402
from sandbox.bwrap import BwrapSandbox  # noqa: E402
from sandbox.process import run_captured  # noqa: E402

COMMAND = ["/bin/true"]


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean_ms": statistics.fmean(samples) * 1e3,
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
    }


async def _bare(n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        run = await run_captured(COMMAND, stdin=None, timeout_s=10, max_output_bytes=1 << 20)
        samples.append(time.perf_counter() - start)
        if run.returncode != 0:
            raise RuntimeError(f"bare subprocess failed: {run}")
    return samples


async def _bwrap(n: int, errors: list[str]) -> tuple[list[float], bool]:
    sandbox = BwrapSandbox(limits=SandboxLimits())
    try:
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            result = await sandbox.exec(COMMAND)
            elapsed = time.perf_counter() - start
            if result.status is ExecStatus.FINISHED and result.exit_code == 0:
                samples.append(elapsed)
            else:  # counted and shown, never folded into the latencies
                errors.append(f"{result.status.value}: {result.stderr.strip()[:200]}")
        return samples, sandbox.cgroup_enforced
    finally:
        await sandbox.close()


async def measure_exec_overhead(n: int) -> dict[str, object]:
    """Run ``n`` execs of ``/bin/true`` bare and under bwrap (interleaved halves, after a
    warm-up) and report latencies, the per-exec overhead and the bwrap/bare ratio."""
    if n < 2:
        raise ValueError("n must be >= 2")
    errors: list[str] = []
    await _bare(3)
    await _bwrap(3, [])
    half = n // 2
    bare = await _bare(half)
    wrapped, cgroup = await _bwrap(half, errors)
    bare += await _bare(n - half)
    more, _ = await _bwrap(n - half, errors)
    wrapped += more
    if not wrapped:
        raise RuntimeError(f"every sandboxed exec failed: {errors[:3]}")
    b, w = _summary(bare), _summary(wrapped)
    return {
        "n": n,
        "command": COMMAND,
        "cgroup_enforced": cgroup,
        "bare": b,
        "bwrap": w,
        "overhead_ms_p50": w["p50_ms"] - b["p50_ms"],
        "ratio_p50": w["p50_ms"] / b["p50_ms"],
        "ratio_mean": w["mean_ms"] / b["mean_ms"],
        "errors": len(errors),
        "error_samples": errors[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args()
    figures = asyncio.run(measure_exec_overhead(args.n))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    b, w = figures["bare"], figures["bwrap"]
    assert isinstance(b, dict) and isinstance(w, dict)
    print(f"exec of {' '.join(COMMAND)} x{args.n} (cgroup: {figures['cgroup_enforced']})")
    print(
        f"  bare subprocess  p50 {b['p50_ms']:7.2f} ms  p99 {b['p99_ms']:7.2f} ms  "
        f"mean {b['mean_ms']:7.2f} ms"
    )
    print(
        f"  bwrap sandbox    p50 {w['p50_ms']:7.2f} ms  p99 {w['p99_ms']:7.2f} ms  "
        f"mean {w['mean_ms']:7.2f} ms"
    )
    print(
        f"  overhead p50 {figures['overhead_ms_p50']:.2f} ms per exec; "
        f"ratio bwrap/bare p50 {figures['ratio_p50']:.2f}x, mean {figures['ratio_mean']:.2f}x"
    )
    print(f"  sandboxed exec errors: {figures['errors']} {figures['error_samples'] or ''}")


if __name__ == "__main__":
    main()

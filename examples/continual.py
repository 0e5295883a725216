"""Continual RL with a live env mix: train `examples/continual.toml`, and at a set step
add the vault env to the run's mix through the run's own API, as a user would.

    python examples/continual.py --seed 0 [--add-at 60] [--config examples/continual.toml]

It runs `agentflow train CONFIG --ui-port 0` (the trainer serves the run's dashboard and
controls on a loopback port), waits until the run has recorded step `--add-at`, sends
`PATCH /v1/runs/{id}` with the vault env at equal weight, and when training ends prints
each env's reward over the run: guess-the-number just before the change and at the end
(forgetting), the vault when it joined and at the end (learning). The figures also go to
`<run dir>/continual.json`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

GUESS, VAULT = "agentflow/guess-number-v0", "agentflow/vault-v0"
WINDOW = 10  # steps averaged for each figure (a step's batch is 16 groups)


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def _add_vault(base: str, metrics: Path, add_at: int, done: threading.Event) -> dict[str, Any]:
    """Once step `add_at` is recorded: the vault env joins the mix at equal weight."""
    while not done.is_set():
        if any(r["step"] >= add_at for r in _rows(metrics)):
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"training ended before step {add_at}")
    run_id = httpx.get(f"{base}/ui/api/runs", timeout=30).json()["items"][0]["id"]
    change = {"set": [{"id": VAULT, "weight": 1.0, "max_concurrency": 256}]}
    answer = httpx.patch(f"{base}/v1/runs/{run_id}", json=change, timeout=60)
    answer.raise_for_status()
    revision = answer.json()["env_revisions"][-1]
    print(f"[continual] added {VAULT} at step {add_at}: revision {revision}", flush=True)
    return dict(revision)


def report(rows: list[dict[str, Any]], added_step: int) -> dict[str, Any]:
    """Each env's mean reward in the windows that tell forgetting and learning apart."""
    before = [r for r in rows if added_step - WINDOW < r["step"] <= added_step]
    after = [r for r in rows if added_step < r["step"] <= added_step + WINDOW]
    end = rows[-WINDOW:]
    figures = {
        "added_after_step": added_step,
        "steps": rows[-1]["step"] if rows else 0,
        "guess_before_change": _mean(before, f"env/{GUESS}/reward"),
        "guess_at_end": _mean(end, f"env/{GUESS}/reward"),
        "vault_when_added": _mean(after, f"env/{VAULT}/reward"),
        "vault_at_end": _mean(end, f"env/{VAULT}/reward"),
    }
    if figures["guess_before_change"] is not None and figures["guess_at_end"] is not None:
        figures["guess_change"] = round(figures["guess_at_end"] - figures["guess_before_change"], 4)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("continual.toml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--add-at", type=int, default=60, help="step after which the vault joins")
    args = parser.parse_args()

    document = tomllib.loads(args.config.read_text())
    document["seed"] = args.seed
    document["name"] = f"{document['name']}-s{args.seed}"
    run_dir = Path(document.get("trainer", {}).get("run_dir", "runs")) / document["name"]
    metrics = run_dir / "metrics.jsonl"
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "continual.json"
        config.write_text(json.dumps(document))
        command = [sys.executable, "-m", "trainer.cli", "train", str(config), "--ui-port", "0"]
        trainer = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        done = threading.Event()
        added: dict[str, Any] = {}
        adder: threading.Thread | None = None
        assert trainer.stdout is not None
        try:
            for line in trainer.stdout:
                print(line, end="", flush=True)
                if line.startswith("dashboard: ") and adder is None:
                    base = line.removeprefix("dashboard: ").strip().removesuffix("/ui")

                    def add(base: str = base) -> None:
                        added.update(_add_vault(base, metrics, args.add_at, done))

                    adder = threading.Thread(target=add, daemon=True)
                    adder.start()
        finally:
            done.set()
            code = trainer.wait()
    if code != 0:
        sys.exit(f"training failed ({code})")
    if not added:
        sys.exit("the vault env was never added: is --add-at past the run's steps?")
    figures = report(_rows(metrics), args.add_at)
    figures["revision"] = added
    (run_dir / "continual.json").write_text(json.dumps(figures, indent=2, default=str))
    print(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()

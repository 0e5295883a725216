"""RTPO end to end in both process forms: episodes are re-rolled from their later turns,
the continuations are stored in the turn tree as siblings of the turns they replace,
each is a trajectory with its own return, and the trainer updates turn depth by depth,
deepest first (`rtpo_depths` steps per batch)."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_distill_run import cli, train_split

pytestmark = pytest.mark.integration

STEPS = 2
VAULT = "agentflow/vault-v0"


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "rtpo-test",
        "seed": 1,
        "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}},
        "engine": {"type": "local", "max_batch_size": 32},
        "envs": [{"id": VAULT, "max_concurrency": 32}],
        "agent": {"max_turns": 3, "max_new_tokens": 4},
        "rollout": {"group_size": 2, "max_staleness": 1},
        "trainer": {
            "algorithm": "rtpo",
            "batch_episodes": 12,  # 2 groups of 2 episodes x (1 + 2 re-rolls)
            "steps": STEPS,
            "checkpoint_every": 2,
            "run_dir": str(tmp_path / "runs"),
        },
        "rtpo": {"branches": 1},
    }


def _check_trees(database: Path, run_id: str | None = None) -> None:
    """The run's completed episodes (the database may hold other tests' runs)."""
    with sqlite3.connect(database) as db:
        query = "SELECT id FROM episodes WHERE status = 'completed'"
        args: tuple[str, ...] = ()
        if run_id is not None:
            query += " AND run_id = ?"
            args = (run_id.replace("-", ""),)
        episodes = db.execute(query + " LIMIT 5", args).fetchall()
        assert episodes
        for (episode,) in episodes:
            turns = db.execute(
                "SELECT id, parent_id, kind, reward FROM turns WHERE episode_id = ?", (episode,)
            ).fetchall()
            kind = {t[0]: t[2] for t in turns}
            children = Counter(t[1] for t in turns if t[2] == "policy")
            # Two env turns (after the key, after the first dial) have a re-rolled sibling.
            branched = [p for p, n in children.items() if n == 2]
            assert len(branched) == 2 and all(kind[p] == "env" for p in branched)
            rows = db.execute(
                "SELECT leaf_turn_id, reward FROM trajectories WHERE episode_id = ?", (episode,)
            ).fetchall()
            assert len(rows) == 3  # the episode and its two continuations
            parent = {t[0]: t[1] for t in turns}
            reward = {t[0]: t[3] or 0.0 for t in turns}
            for leaf, trajectory_reward in rows:
                path_reward, node = 0.0, leaf
                while node is not None:
                    path_reward += reward[node]
                    node = parent[node]
                assert trajectory_reward == pytest.approx(path_reward)  # its own return


def _check_metrics(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["rtpo_depths"] == 3.0 and row["optimizer_steps"] == 3.0
        assert row["rtpo_turns"] == 4 * 6  # per episode: 3 turns + 2 + 1 re-rolled
        assert row["rtpo_branch_points"] == 4 * 2


def test_the_embedded_trainer_runs_rtpo(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps(_config(tmp_path)))
    done = cli("train", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "rtpo-test"
    _check_metrics(run_dir)
    _check_trees(run_dir / "agentflow.db")


def test_the_split_trainer_runs_rtpo(sqlite_database: str, tmp_path: Path) -> None:
    run_id = train_split(_config(tmp_path), sqlite_database, tmp_path)
    _check_metrics(tmp_path / "runs" / "rtpo-test")
    _check_trees(Path(sqlite_database.split("///", 1)[1]), run_id)

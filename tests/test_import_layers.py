"""The house has one direction (docs/architecture.md, "Dependency rules"): no import
circles, and no package importing one above it in

    sandbox < envs < agentflow < trainer < bench

nor one of the few `FORBIDDEN` imports within a package.

Every import counts, lazy ones inside functions and `TYPE_CHECKING` ones included
(tests/support/module_graph.py). The last two tests show the check failing on a copy of
the tree with a module added that breaks each rule.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.module_graph import (
    ROOT,
    circles,
    import_graph,
    project_modules,
    upward_imports,
)

LAYERS = ("sandbox", "envs", "agentflow", "trainer", "bench")
# Within a package: (importer, imported) prefixes that must never meet.
FORBIDDEN = (
    ("agentflow.inference", "agentflow.api"),  # an engine is usable without the gateway
    ("agentflow.db", "agentflow.api"),  # and so is the turn store
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def problems(root: Path) -> list[str]:
    """Every upward or forbidden import and every circle under `root`, one line each,
    naming files."""
    graph = import_graph(project_modules(root, LAYERS))
    upward = [f"upward: {edge.describe(root)}" for edge in upward_imports(graph, LAYERS)]
    forbidden = [
        f"forbidden ({source} must not import {target}): {edge.describe(root)}"
        for edges in graph.values()
        for edge in edges
        for source, target in FORBIDDEN
        if _under(edge.source, source) and _under(edge.target, target)
    ]
    circled = [f"circle of {circle.describe(root)}" for circle in circles(graph)]
    return upward + forbidden + circled


def test_imports_flow_one_way_with_no_circles() -> None:
    found = problems(ROOT)
    assert not found, "\n".join(found)


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph(project_modules(ROOT, LAYERS))
    targets = {edge.target for edges in graph.values() for edge in edges}
    assert {"agentflow.errors", "envs.base", "sandbox.base", "trainer.loop"} <= targets
    assert len(graph) > 200  # every module of the five packages, not a few


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The five packages' sources, copied: the tree itself is never touched."""
    for package in LAYERS:
        shutil.copytree(
            ROOT / package,
            tmp_path / package,
            ignore=shutil.ignore_patterns("__pycache__", "_migrations", "static"),
        )
    return tmp_path


def test_an_upward_import_is_named(tree_copy: Path) -> None:
    probe = tree_copy / "envs" / "upward_probe.py"
    probe.write_text(
        "def train_here() -> None:\n    from trainer.loop import train  # lazy, and still upward\n"
    )
    added = set(problems(tree_copy)) - set(problems(ROOT))
    assert added == {"upward: envs/upward_probe.py:2 imports trainer.loop"}


def test_a_circle_is_named_with_its_loop(tree_copy: Path) -> None:
    (tree_copy / "envs" / "circle_a.py").write_text("from envs import circle_b\n")
    (tree_copy / "envs" / "circle_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from envs.circle_a import Thing\n"
    )
    added = set(problems(tree_copy)) - set(problems(ROOT))
    assert added == {
        "circle of 2 modules (envs.circle_a, envs.circle_b): "
        "envs/circle_a.py:1 imports envs.circle_b -> envs/circle_b.py:3 imports envs.circle_a"
    }


def test_a_forbidden_import_within_a_package_is_named(tree_copy: Path) -> None:
    (tree_copy / "agentflow" / "db" / "probe.py").write_text("import agentflow.api.errors\n")
    added = set(problems(tree_copy)) - set(problems(ROOT))
    assert added == {
        "forbidden (agentflow.db must not import agentflow.api): "
        "agentflow/db/probe.py:1 imports agentflow.api.errors"
    }

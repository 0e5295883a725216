"""Only product code in the product: every module under the product packages is reached
from the product's own entry points, not only from tests or benchmarks.

The walk is static (ast): `import a.b`, `from a import b` (b a module or a name),
relative imports, at module level and inside functions. It starts from the console
scripts and entry points in pyproject.toml, `agentflow.api.app`, every product module
with an `if __name__ == "__main__":` block or run with `python -m` by product code, the
dotted paths (`"pkg.mod:attr"`, `"pkg.mod"`) written in product code, as the env
registry's built-ins are, the migration scripts alembic runs, and the few modules that
are a library for users' own code (`LIBRARY`, each with its reason). A path built as
`f"pkg.{name}"` is joined with the module's string constants
(`"guess_number:GuessNumberEnv"` gives `pkg.guess_number`). Importing a module runs its
packages' `__init__`, so those count as reached, and so do their imports. A fake or
simulator used only by tests or benchmarks belongs in `tests/support/` or `bench/`.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from tests.support.module_graph import MIGRATIONS, ROOT, ModuleFacts, project_modules

PACKAGES = ("agentflow", "envs", "sandbox", "trainer")
ROOTS = ("agentflow.api.app",)
# Modules whose users are other programs, not our entry points.
LIBRARY = {
    "sandbox.client": "HttpSandbox, the client of `python -m sandbox.service`",
    "envs.adapters.as_gymnasium": "our envs as Gymnasium envs, for users' own loops",
}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_][\w.]*)?")


def product_modules() -> dict[str, Path]:
    return project_modules(ROOT, PACKAGES)


def _is_main_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    left, right = node.test.left, node.test.comparators
    return (
        isinstance(left, ast.Name)
        and left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in right)
    )


class EntryFacts(ModuleFacts):
    """What one module's source says about which modules it makes run."""

    def dotted_paths(self) -> Iterator[str]:
        """Module names written as strings: plain, `-m` arguments, and f-string prefixes."""
        strings = self.strings()
        for value in strings:
            if DOTTED.fullmatch(value):
                yield value.partition(":")[0]
        for node in ast.walk(self.tree):
            if isinstance(node, ast.JoinedStr) and node.values:
                head = node.values[0]
                prefix = head.value if isinstance(head, ast.Constant) else None
                if isinstance(prefix, str) and prefix.endswith("."):
                    for value in strings:
                        if DOTTED.fullmatch(value):
                            yield prefix + value.partition(":")[0]

    def is_entry_point(self) -> bool:
        return any(_is_main_block(node) for node in self.tree.body)

    def run_with_dash_m(self) -> Iterator[str]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.List | ast.Tuple):
                items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                for flag, module in zip(items, items[1:], strict=False):
                    if flag == "-m" and isinstance(module, str):
                        yield module


def console_scripts() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = [project.get("scripts", {}), *project.get("entry-points", {}).values()]
    return [target.partition(":")[0] for group in groups for target in group.values()]


def reachable(modules: dict[str, Path]) -> set[str]:
    facts = {name: EntryFacts(name, path) for name, path in modules.items()}
    start = {*console_scripts(), *ROOTS, *LIBRARY}
    for script in sorted(MIGRATIONS.resolve().rglob("*.py")) if MIGRATIONS.exists() else []:
        start |= set(EntryFacts("agentflow._migrations.script", script).imports())
    start |= {name for name, f in facts.items() if f.is_entry_point()}
    seen: set[str] = set()
    todo = [m for m in start if m in modules]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        # Importing a module runs every package above it.
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        # What a reached module imports, names as a dotted path, or runs with `-m`.
        f = facts[name]
        named = {*f.imports(), *f.dotted_paths(), *f.run_with_dash_m()}
        todo += [m for m in named if m in modules and m not in seen]
    return seen


def test_every_product_module_is_reached_from_the_product() -> None:
    modules = product_modules()
    assert "trainer.cli" in modules and "envs.registry" in modules
    unreached = sorted(set(modules) - reachable(modules))
    assert not unreached, (
        "product modules that only tests or benchmarks import (move them to tests/support/ "
        "or bench/, or delete them): " + ", ".join(unreached)
    )


def test_the_walk_sees_imports_strings_and_f_string_prefixes() -> None:
    modules = product_modules()
    found = reachable(modules)
    assert {
        "trainer.cli",
        "agentflow.cli",
        "agentflow.api.app",
        "envs.server",
        "sandbox.service",
    } <= found
    assert "envs.builtin.guess_number" in found  # registered as f"envs.builtin.{entry}"
    assert "agentflow" in found and "agentflow.api" in found  # packages of reached modules

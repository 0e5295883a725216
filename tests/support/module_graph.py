"""The project's modules and the imports between them, read from the source (ast).

An import is any `import a.b` or `from a import b` in a module's source: at module level,
inside a function (a lazy import), or under `if TYPE_CHECKING:`, because each is a file a
reader must open to understand this one. `from a import b` points at the module `a.b`
when there is one, else at `a` (a name from it). Relative imports are made absolute.
Importing `a.b` also runs the package `a`, but that edge is not counted: a package's
`__init__` that re-exports its own modules is not a circle.

Used by `tests/test_import_layers.py` (one direction, no circles) and
`tests/test_product_modules.py` (every product module is reached from the product).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The migration scripts that alembic runs from their directory: not modules to import.
MIGRATIONS = ROOT / "agentflow" / "_migrations"


def project_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted name -> source file, for every module of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.is_relative_to(root / "agentflow" / "_migrations"):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


@functools.lru_cache(maxsize=4096)
def _parsed(path: Path, mtime_ns: int) -> ast.Module:
    """A source file's tree, parsed once per process while the file is unchanged."""
    return ast.parse(path.read_text(), filename=str(path))


class ModuleFacts:
    """What one module's source says about the modules it imports or names."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.is_package = path.name == "__init__.py"
        self.tree = _parsed(path, path.stat().st_mtime_ns)

    def _package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self._package().split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def import_statements(self) -> Iterator[tuple[int, list[str]]]:
        """(line, candidates) per imported name: for `from a import b`, `a.b` then `a`."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node.lineno, [alias.name]
            elif isinstance(node, ast.ImportFrom):
                module = self._absolute(node)
                for alias in node.names:
                    yield node.lineno, [f"{module}.{alias.name}", module]

    def imports(self) -> Iterator[str]:
        """Every dotted name an import statement could mean (modules and names alike)."""
        for _, candidates in self.import_statements():
            yield from candidates

    def strings(self) -> list[str]:
        return [
            node.value
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]


@dataclass(frozen=True)
class Import:
    """`source` imports `target` at `line` of `path` (both project modules)."""

    source: str
    target: str
    path: Path
    line: int

    def describe(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line} imports {self.target}"


def _resolve(candidates: Sequence[str], modules: Mapping[str, Path]) -> str | None:
    """The project module an import means: the first candidate that is one, else the
    longest module prefix of the last (`import a.b.c` where `a.b` is the module)."""
    for name in candidates:
        if name in modules:
            return name
    parts = candidates[-1].split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def import_graph(modules: Mapping[str, Path]) -> dict[str, list[Import]]:
    """Each module's imports of other project modules, one per (target, line)."""
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        facts = ModuleFacts(name, path)
        seen: set[tuple[str, int]] = set()
        edges = []
        for line, candidates in facts.import_statements():
            target = _resolve(candidates, modules)
            if target is None or (target, line) in seen:
                continue
            seen.add((target, line))
            edges.append(Import(name, target, path, line))
        graph[name] = sorted(edges, key=lambda e: (e.line, e.target))
    return graph


def layer_of(module: str, layers: Sequence[str]) -> int:
    return layers.index(module.partition(".")[0])


def upward_imports(graph: Mapping[str, list[Import]], layers: Sequence[str]) -> list[Import]:
    """Imports from a package into one above it in `layers` (lowest first)."""
    return [
        edge
        for edges in graph.values()
        for edge in edges
        if layer_of(edge.target, layers) > layer_of(edge.source, layers)
    ]


def _strongly_connected(graph: Mapping[str, list[Import]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph is deep enough to matter)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for edge in edges:
                nxt = edge.target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_loop(graph: Mapping[str, list[Import]], members: set[str]) -> list[Import]:
    """One loop of imports through the component's first member, fewest steps."""
    start = min(members)
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target not in members:
                    continue
                if edge.target == start:
                    loop = [edge]
                    while loop[0].source != start:
                        loop.insert(0, came_by[loop[0].source])
                    return loop
                if edge.target not in came_by:
                    came_by[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no loop through {start}")  # a component of 2+ always has one


@dataclass(frozen=True)
class Circle:
    """Modules that import each other, directly or through others: every member, and
    one loop of imports among them."""

    members: list[str]
    loop: list[Import]

    def describe(self, root: Path) -> str:
        steps = " -> ".join(edge.describe(root) for edge in self.loop)
        return f"{len(self.members)} modules ({', '.join(self.members)}): {steps}"


def circles(graph: Mapping[str, list[Import]]) -> list[Circle]:
    """Every import circle. A module importing itself (a `python -m` entry that runs the
    importable copy of its own module) is one file, not a circle."""
    found = []
    for members in _strongly_connected(graph):
        if len(members) > 1:
            found.append(Circle(members, _shortest_loop(graph, set(members))))
    return found

"""The layers of the two products: which part may import which, and no import circles.

Every module of ``onnx2soap/`` and ``executor/`` is read with ``ast`` (nothing is
imported), and every import in it is an arrow: at module level or inside a function, and
under ``if TYPE_CHECKING:`` too, since a name a module needs for its types is still a
dependency of its design. ``MAY_IMPORT`` below is the rule; a test checks that the rule
itself runs one way, so a new arrow back up fails here rather than in review.

To add a package: give it a row, naming only what sits below it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTS = ("onnx2soap", "executor")

# The foundation: errors, plain data and the parsing both command lines share. Its
# modules import nothing above it (among themselves: no circles, checked below).
CORE = (
    "onnx2soap",  # the package itself: its version
    "onnx2soap.errors",
    "onnx2soap.precision",
    "onnx2soap.device_kind",
    "onnx2soap.ir",
    "onnx2soap.files",
    "onnx2soap.options",
)
OPS = (*CORE, "onnx2soap.ops")
# Below the simulator and the executor alike: ONNX in, and the one partition math.
SHARED = (*OPS, "onnx2soap.importer", "onnx2soap.soap")
SIM = (*SHARED, "onnx2soap.sim")

# Each part (a package or a module), and what it may import besides its own modules.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    **{unit: CORE for unit in CORE},
    "onnx2soap.ops": CORE,
    "onnx2soap.importer": OPS,
    "onnx2soap.soap": OPS,
    # Reads machine files and cost databases; never runs a kernel or a link itself.
    "onnx2soap.sim": SHARED,
    "onnx2soap.search": SIM,
    "onnx2soap.viz": SIM,
    # Runs plans: the plan file is its only contract with planning (no sim, no search).
    "executor": SHARED,
    # Runs the executor's kernels and links to write what sim reads.
    "onnx2soap.measure": (*SIM, "onnx2soap.search", "executor"),
    # What ``onnx2soap inspect`` shows of a model, typed (the command and the API's).
    "onnx2soap.inspection": SHARED,
    # The Python API: plan, simulate, inspect; beside the command, never below it.
    "onnx2soap.api": (*SIM, "onnx2soap.search", "onnx2soap.inspection"),
    # The onnx2soap command: planning and measuring, never the executor directly.
    "onnx2soap.cli": (
        *SIM,
        "onnx2soap.search",
        "onnx2soap.viz",
        "onnx2soap.measure",
        "onnx2soap.inspection",
    ),
    "onnx2soap.__main__": ("onnx2soap.cli",),
}


@dataclass(frozen=True)
class Arrow:
    source: str  # module
    target: str  # module
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the products."""
    found = {}
    for top in PRODUCTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, its dots resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _known(name: str, known: dict[str, Path]) -> str | None:
    """The product module ``name`` is or lies in (None: another library)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@cache
def arrows(module: str) -> tuple[Arrow, ...]:
    """Every import of a product module by ``module``, read once (one arrow per target
    and line, however many names it takes)."""
    return tuple(dict.fromkeys(_arrows(module)))


def _arrows(module: str) -> Iterator[Arrow]:
    """``from pkg import sub`` points at ``pkg.sub`` where that is a module (not at
    ``pkg``'s ``__init__``)."""
    known = modules()
    path = known[module]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _known(name, known)
            if target is not None and target != module:
                yield Arrow(module, target, node.lineno)


def unit(module: str) -> str | None:
    """The row of ``MAY_IMPORT`` a module belongs to: the longest that names it or a
    package above it (the bare ``onnx2soap`` row names only the package's own file)."""
    best = None
    for name in MAY_IMPORT:
        inside = module == name or (module.startswith(name + ".") and name != "onnx2soap")
        if inside and (best is None or len(name) > len(best)):
            best = name
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Kosaraju: the nodes in
    order of finishing, then the reversed graph walked in the opposite order)."""
    order, seen = [], set()
    for start in graph:
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, todo = stack[-1]
            nxt = next((n for n in todo if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    reverse: dict[str, set[str]] = {n: set() for n in graph}
    for a, targets in graph.items():
        for b in targets:
            reverse[b].add(a)
    found, assigned = [], set()
    for start in reversed(order):
        if start in assigned:
            continue
        component, todo = [], [start]
        assigned.add(start)
        while todo:
            node = todo.pop()
            component.append(node)
            fresh = reverse[node] - assigned
            assigned |= fresh
            todo.extend(fresh)
        if len(component) > 1:
            found.append(sorted(component))
    return found


def import_graph() -> dict[str, set[str]]:
    return {m: {a.target for a in arrows(m)} for m in modules()}


def _down_order(table: dict[str, Iterable[str]]) -> list[str]:
    """The rows bottom up (each after all it may import); an AssertionError names the
    rows left when the rule itself runs round a circle."""
    placed: list[str] = []
    left = {k: set(v) - {k} for k, v in table.items()}
    while left:
        ready = sorted(k for k, below in left.items() if below <= set(placed))
        assert ready, f"MAY_IMPORT runs round a circle among {sorted(left)}"
        placed += ready
        for k in ready:
            del left[k]
    return placed


# --- the rule ------------------------------------------------------------------------------


def test_the_rule_runs_one_way() -> None:
    """Apart from the foundation, whose modules may import each other, no two parts may
    import each other, directly or round a longer circle: the parts form layers."""
    above_core = {k: v for k, v in MAY_IMPORT.items() if k not in CORE}
    assert all(set(v) <= set(MAY_IMPORT) for v in MAY_IMPORT.values())
    order = _down_order({k: [t for t in v if t not in CORE] for k, v in above_core.items()})
    assert order.index("executor") < order.index("onnx2soap.measure")
    assert order.index("onnx2soap.sim") < order.index("onnx2soap.measure")


def test_the_executor_never_reaches_planning() -> None:
    """The plan file is the only contract between planning and running."""
    for planning in ("onnx2soap.sim", "onnx2soap.search", "onnx2soap.cli"):
        assert planning not in MAY_IMPORT["executor"]
    for below in ("onnx2soap.sim", "onnx2soap.soap", "onnx2soap.importer", "executor"):
        assert "onnx2soap.measure" not in MAY_IMPORT[below]


def test_a_circle_and_an_arrow_back_up_are_found() -> None:
    """The checks below can fail: a made-up circle is found, and ``unit`` places the
    moved measuring code above the simulator."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert unit("onnx2soap.measure.profiler") == "onnx2soap.measure"
    assert unit("onnx2soap.sim.costdb") == "onnx2soap.sim"
    assert unit("onnx2soap") == "onnx2soap" and unit("onnx2soap.newthing") is None
    assert "executor" not in MAY_IMPORT[unit("onnx2soap.sim.costdb")]
    with pytest.raises(AssertionError, match="circle"):
        _down_order({"a": ["b"], "b": ["a"]})


# --- the code ------------------------------------------------------------------------------


def test_every_module_has_a_place() -> None:
    lost = [m for m in modules() if unit(m) is None]
    assert not lost, f"add a MAY_IMPORT row for {lost}"


def test_no_import_runs_back_up() -> None:
    wrong = []
    for module in modules():
        here = unit(module)
        for arrow in arrows(module):
            there = unit(arrow.target)
            if there is not None and there != here and there not in MAY_IMPORT[here]:
                wrong.append(f"{arrow}: {here} may not import {there}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_modules_import_each_other() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_measuring_layer_is_where_the_mpi_runs_start() -> None:
    """What ``onnx2soap machine probe`` and ``profile`` run under mpiexec is in it."""
    assert "onnx2soap.measure.probe" in modules()
    assert "onnx2soap.measure.profiler" in modules()
    sim = [m for m in modules() if unit(m) == "onnx2soap.sim"]
    assert not [m for m in sim if m.rpartition(".")[2] in ("probe", "profiler")]

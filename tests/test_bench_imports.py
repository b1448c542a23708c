"""The benches in tools/ share one harness and never import each other: `tools/bench.py` puts them together, every
other `bench*` module imports only the harness (the `bench_harness*` modules, which may import each other), and no
import among the modules of tools/ goes round in a circle. Read from the sources (`ast`), nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
DISPATCHER = "bench"
HARNESS = "bench_harness"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, those inside functions too; `tools.x` as `x`."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tools":  # `from tools import bench_daemon`
                found += [(alias.name, node.lineno) for alias in node.names]
            else:
                found.append((node.module, node.lineno))
    return [(name.removeprefix("tools."), line) for name, line in found]


def _modules() -> dict[str, Path]:
    return {path.stem: path for path in sorted(TOOLS.glob("*.py"))}


def test_no_bench_imports_another_bench_but_through_the_harness() -> None:
    modules = _modules()
    benches = {name for name in modules if name.startswith("bench")}
    assert DISPATCHER in benches and any(name.startswith(HARNESS) for name in benches), sorted(benches)
    offending = [
        f"tools/{name}.py:{line} imports {imported}"
        + (" (a harness module imports only the harness)" if name.startswith(HARNESS) else
           " (only tools/bench.py puts benches together; share a helper through a bench_harness* module)")
        for name in sorted(benches - {DISPATCHER})
        for imported, line in _imports(modules[name])
        if (top := imported.split(".")[0]) in benches and not top.startswith(HARNESS)
    ]
    assert not offending, "a bench imports another bench:\n" + "\n".join(offending)


def test_the_imports_among_tools_modules_have_no_cycle() -> None:
    modules = _modules()
    graph: dict[str, list[tuple[str, int]]] = {
        name: [(top, line) for imported, line in _imports(path) if (top := imported.split(".")[0]) in modules]
        for name, path in modules.items()
    }
    done: set[str] = set()
    cycles: list[str] = []

    def visit(name: str, path: list[tuple[str, int]]) -> None:
        on_path = [step for step, _ in path]
        if name in on_path:
            loop = path[on_path.index(name):]
            cycles.append(" -> ".join(f"tools/{step}.py:{line} imports {after}" for (step, line), after
                                      in zip(loop, [*on_path[on_path.index(name) + 1:], name], strict=True)))
            return
        if name in done:
            return
        for imported, line in graph[name]:
            visit(imported, [*path, (name, line)])
        done.add(name)

    for name in graph:
        visit(name, [])
    assert not cycles, "an import cycle among tools/ modules:\n" + "\n".join(cycles)

"""The layers, checked by reading every module's imports (at the top, inside functions, under TYPE_CHECKING alike).

    events < policies < recovery.core < recovery.plugins < recovery.settings < recovery.log < recovery.agent
        < recovery.slurm < recovery.sim < recovery.report < recovery.service < recovery.cli

`recovery.client`, the SDK training scripts import, stands alone: it imports nothing of ours and only the standard
library, so that it installs into any training environment (torch only in `recovery.client.torch` and
`recovery.client.memory`, and only inside their functions, so that importing the SDK never imports torch).

A module imports only from its own layer or lower ones; `recovery.testing` (what users and plugin authors test with)
may import any layer up to `recovery.sim`, and nothing in the product imports it, `tests` or `tools`. The core does
no I/O and reads no clock. No two modules import each other, however indirectly: an import placed inside a
function to dodge a cycle is a cycle here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("events", "policies", "recovery")
LAYERS = ("events", "policies", "recovery.core", "recovery.plugins", "recovery.settings", "recovery.log",
          "recovery.agent", "recovery.slurm", "recovery.sim", "recovery.report", "recovery.service", "recovery.cli")
"""lowest first"""
TESTING = "recovery.testing"
TESTING_MAY_IMPORT = LAYERS[: LAYERS.index("recovery.sim") + 1]
NOT_THE_PRODUCT = ("recovery.testing", "tests", "tools")
CLIENT = "recovery.client"
CLIENT_TORCH = "recovery.client.torch"
CLIENT_MEMORY = "recovery.client.memory"
"""the in-memory checkpoint tier's tensor copies: torch inside its functions, as in `recovery.client.torch`"""
CLIENT_DDP = "recovery.client.ddp"
CLIENT_BACKEND = "recovery.client._backend"  # the process group's backends (torch inside its functions)
CLIENT_PINNED = "recovery.client._pinned"  # GPU tensors into the memory tier (torch inside its functions)
"""a DDP script's helpers, imported by the script itself (never by `recovery.client`): torch at its top"""
CLIENT_INTEGRATIONS = {
    "recovery.client.fsdp": {"torch"},
    "recovery.client.shards": {"torch"},  # fsdp's memory copies, imported by it after torch
    "recovery.client.dcp_pieces": {"torch"},  # shards' DCP pieces, imported by it when a dying checkpoint is written
    "recovery.client.reshard": {"torch"},  # fsdp's resharding at a scale, imported by it after torch
    "recovery.client.lightning": {"torch", "lightning", "pytorch_lightning", "lightning_fabric"},
    "recovery.client.accelerate": {"torch", "accelerate"},
}
"""the integrations a script imports itself, each with the framework it plugs into (never `recovery.client`'s)"""
CORE_MAY_NOT_IMPORT = frozenset({
    "anyio", "asyncio", "concurrent", "datetime", "glob", "http", "io", "logging", "multiprocessing", "nats", "os",
    "pathlib", "pickle", "prometheus_client", "random", "rich", "select", "selectors", "shutil", "signal", "socket",
    "sqlite3", "ssl", "subprocess", "sys", "tempfile", "threading", "time", "urllib",
})
"""I/O, clocks, processes, unseeded randomness and the network: the engine's world comes in as records only"""


@cache
def modules() -> dict[str, Path]:
    """Every module of the three packages by its dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def read_imports(source: str, name: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of a module's source, wherever it sits. `from a import b`
    is an import of `a.b` when that is a module of ours, else of `a`."""
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                found.append((submodule if submodule in modules() else origin, node.lineno))
    return found


@cache
def imports(name: str) -> tuple[tuple[str, int], ...]:
    path = modules()[name]
    return tuple(read_imports(path.read_text(), name, path.name == "__init__.py"))


def internal(target: str) -> str | None:
    """The module of ours an import names (the longest known prefix), or None for another distribution's."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules():
            return candidate
    return None


def layer(name: str) -> int | None:
    for index, prefix in enumerate(LAYERS):
        if name == prefix or name.startswith(prefix + "."):
            return index
    return None


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def where(name: str, line: int) -> str:
    return f"{modules()[name].relative_to(ROOT)}:{line}"


def test_every_module_sits_in_a_layer() -> None:
    """A new folder under recovery/ takes its place in the order here, deliberately."""
    homeless = [name for name in modules()
                if name != "recovery" and not within(name, TESTING) and not within(name, CLIENT)
                and layer(name) is None]
    assert not homeless, homeless


def test_the_package_root_imports_nothing() -> None:
    assert imports("recovery") == ()


def test_no_layer_imports_a_higher_one() -> None:
    wrong = []
    for name in modules():
        own = layer(name)
        if own is None:
            continue
        for target, line in imports(name):
            module = internal(target)
            theirs = None if module is None else layer(module)
            if theirs is not None and theirs > own:
                wrong.append(f"{where(name, line)}: {LAYERS[own]} imports {module} ({LAYERS[theirs]})")
    assert not wrong, "\n".join(wrong)


def test_the_product_never_imports_the_test_tools_tests_or_tools() -> None:
    wrong = []
    for name in modules():
        for target, line in imports(name):
            if within(name, TESTING) and within(target, TESTING):
                continue
            if any(within(target, prefix) for prefix in NOT_THE_PRODUCT):
                wrong.append(f"{where(name, line)}: {name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_test_tools_use_only_the_layers_up_to_the_simulator() -> None:
    wrong = []
    for name in modules():
        if not within(name, TESTING):
            continue
        for target, line in imports(name):
            module = internal(target)
            if module is None or within(module, TESTING):
                continue
            if not any(within(module, allowed) for allowed in TESTING_MAY_IMPORT):
                wrong.append(f"{where(name, line)}: {name} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_client_imports_nothing_of_ours_and_only_the_standard_library() -> None:
    wrong = []
    for name in modules():
        if not within(name, CLIENT):
            continue
        for target, line in imports(name):
            module = internal(target)
            if module is not None:
                if not within(module, CLIENT):
                    wrong.append(f"{where(name, line)}: {name} imports {module}")
                continue
            top = target.split(".")[0]
            if top == "torch" and name in (CLIENT_TORCH, CLIENT_MEMORY, CLIENT_DDP, CLIENT_BACKEND, CLIENT_PINNED):
                continue
            if top in CLIENT_INTEGRATIONS.get(name, ()):
                continue
            if top not in sys.stdlib_module_names:
                wrong.append(f"{where(name, line)}: {name} imports {target}, not in the standard library")
    assert not wrong, "\n".join(wrong)
    assert any(within(name, CLIENT) for name in modules())


def test_nothing_of_ours_imports_the_client_but_the_client() -> None:
    """The agent speaks the client's protocol from its own side; sharing code would tie their releases."""
    wrong = [f"{where(name, line)}: {name} imports {target}" for name in modules() if not within(name, CLIENT)
             for target, line in imports(name) if (m := internal(target)) is not None and within(m, CLIENT)]
    assert not wrong, "\n".join(wrong)


def test_the_client_imports_torch_only_inside_its_torch_helpers_functions() -> None:
    for name in (CLIENT_TORCH, CLIENT_MEMORY):
        tree = ast.parse(modules()[name].read_text())
        top_level = [node.lineno for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
                     and any((a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0] == "torch"
                             for a in node.names)]
        assert top_level == [], f"torch imported at module level of {name}: lines {top_level}"


def test_importing_the_client_loads_no_third_party_module() -> None:
    """What importing the SDK adds to the modules the interpreter loaded at start (site's own hooks among them)."""
    script = ("import sys; before = set(sys.modules); import recovery.client, recovery.client.torch; "
              "print('\\n'.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True,
                          timeout=60)
    loaded = [m for m in done.stdout.split() if m not in sys.stdlib_module_names and m != "recovery"]
    assert loaded == []


def test_the_core_does_no_io_and_reads_no_clock() -> None:
    wrong = []
    for name in modules():
        if not within(name, "recovery.core"):
            continue
        for target, line in imports(name):
            if target.split(".")[0] in CORE_MAY_NOT_IMPORT:
                wrong.append(f"{where(name, line)}: {name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_importing_the_core_loads_nothing_of_the_layers_above_it() -> None:
    """What the core's own imports pull in, however indirectly: no log, service or network code."""
    script = ("import sys, recovery.core.engine, recovery.core.effects; "
              "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('recovery', 'nats', 'anyio'))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True,
                          timeout=60)
    loaded = done.stdout.split()
    assert [m for m in loaded if not (m == "recovery" or within(m, "recovery.core"))] == []


def find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """One cycle of a directed graph, as a path that ends where it starts, or None (a depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in edges.get(node, []):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    edges = {name: sorted({m for t, _ in imports(name) if (m := internal(t)) is not None and m != name})
             for name in modules()}
    found = find_cycle(edges)
    assert found is None, "import cycle: " + " -> ".join(found)


# -- the checker itself ---------------------------------------------------------------------------------------
def test_the_reader_sees_imports_inside_functions_and_for_type_checking_only() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from recovery.service import config\n"
        "if TYPE_CHECKING:\n"
        "    from recovery.cli.ctl import main\n"
        "def later() -> None:\n"
        "    from . import daemon\n"
        "    import recovery.core.engine\n"
    )
    found = [internal(target) for target, _ in read_imports(source, "recovery.service.demo", is_package=False)]
    assert found == [None, "recovery.service.config", "recovery.cli.ctl", "recovery.service.daemon",
                     "recovery.core.engine"]


def test_the_search_finds_a_cycle_and_only_a_cycle() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None

"""The package's layers point one way: no import cycles, no import of a higher layer, function-level
imports included; `import cuflash` loads no benchmark or command-line module."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cuflash"

# Lowest first. A module may import modules of its own layer or of a lower one.
# A new module gets a row here (the test fails until it has one).
LAYERS = {
    "compile": ["config", "compile", "device", "arrays", "fp8", "tma", "tail_split", "kernel_call", "timing", "score_mods",
                "reference"],
    "launch": ["launch", "decode_launch"],
    "dispatch": ["dispatch"],
    "tuning": ["tune_cache", "tune_common", "tune_fwd", "tune_bwd", "tuner"],
    "face": ["validate", "plans", "forward", "backward", "varlen", "kv_cache", "combine", "dropout_mask", "distributed",
             "jax_callbacks", "jax", "jax_ring", "torch", "torch_fa3", "__init__"],
    "top": ["bench", "cli", "__main__"],
}
RANK = {name: rank for rank, names in enumerate(LAYERS.values()) for name in names}


def module_name(path: Path) -> str:
    """"forward", "cli.info", "cli" (cuflash/cli/__init__.py), "" (cuflash/__init__.py)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """cuflash modules `path` imports anywhere in its body, as names relative to the package."""
    own = module_name(path).split(".") if module_name(path) else []
    package = own if path.name == "__init__.py" else own[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names = [[]]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
                bases = ["cuflash." + base if base else "cuflash"]
            else:
                bases = [node.module]
            names = [[alias.name for alias in node.names]]
        else:
            continue
        for base in bases:
            if base is None or not (base == "cuflash" or base.startswith("cuflash.")):
                continue
            relative = base[len("cuflash."):] if base != "cuflash" else ""
            targets = [relative] if relative else []
            for name in names[0]:
                candidate = f"{relative}.{name}" if relative else name
                if candidate in modules:
                    targets.append(candidate)
            found.update(t for t in targets if t in modules)
    found.discard(module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def layer_of(module: str) -> int:
    top = module.split(".")[0] if module else "__init__"
    if top not in RANK:
        raise AssertionError(f"cuflash/{top}: no layer in tests/test_layers.py's LAYERS")
    return RANK[top]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "dispatch" in graph["forward"] and "launch" in graph["forward"]
    assert "compile" in graph["kernel_call"]
    assert "forward" in graph[""]  # cuflash/__init__.py


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down():
    upward = [(module or "__init__", target) for module, targets in import_graph().items() for target in targets
              if layer_of(target) > layer_of(module)]
    assert upward == []


def test_import_cuflash_loads_no_benchmark_or_cli_module():
    code = ("import sys, cuflash; "
            "print(sorted(m for m in sys.modules if m.startswith(('cuflash.bench', 'cuflash.cli'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=PACKAGE.parent)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["check", "info", "bench", "autotune"])
def test_cli_commands_have_help(command):
    result = subprocess.run([sys.executable, "-m", "cuflash", command, "--help"], capture_output=True, text=True,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()

"""The house's rules that a tool can check (docs/architecture.md): the layers of
.importlinter hold, no two packages import each other, every function-level import says
why it is one, and the engine never asks an object what it is."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshspeed"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imported module, inside a function, line) for every import statement of meshspeed."""
    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, True)
            elif isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue  # annotations only
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function, child
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    base = ".".join(parent + ([child.module] if child.module else []))
                for alias in child.names:
                    yield f"{base}.{alias.name}", in_function, child
            else:
                yield from visit(child, in_function)
    yield from visit(tree, False)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_no_two_packages_import_each_other():
    modules = _modules()
    graph = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for target, in_function, _ in _imports(tree, module, path.name == "__init__.py"):
            while target and target not in modules:  # `from pkg import name` names a module or not
                target = target.rpartition(".")[0]
            if target.startswith("meshspeed") and not in_function and _package(target) != _package(module):
                graph[_package(module)].add(_package(target))
    # every cycle between packages shows as a package reaching itself
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    cyclic = sorted(p for p in list(graph) if p in reach(p))
    assert cyclic == [], f"packages on an import cycle: {cyclic}"


def test_every_function_level_import_says_why():
    unexplained = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for _, in_function, node in _imports(tree, module, path.name == "__init__.py"):
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if in_function and "# lazy:" not in lines[node.lineno - 1] and not above.startswith("# lazy:"):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unexplained == [], f"function-level imports without a `# lazy: <why>` note: {unexplained}"


def test_the_engine_never_probes_an_object():
    """getattr / hasattr with a literal attribute name is asking an object what it is;
    the engine calls protocols (Note [one contract for every axis])."""
    probes = []
    for path in (PACKAGE / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                probes.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert probes == []


def test_the_core_never_names_deepspeed_modules():
    """DeepSpeed's module tree is meshspeed/compat/deepspeed/; below the DeepSpeed layer
    nothing imports it, nor the `meshspeed.<DeepSpeed name>` paths that lead there."""
    from meshspeed.compat.paths import DEEPSPEED_NAMES

    edge = {"compat", "cli", "demo", "tools", "launcher", "testing", "autotune", "<root>"}
    bad = []
    for module, path in _modules().items():
        if _package(module) in edge:
            continue
        for target, _, node in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            head = target.split(".")[1] if target.startswith("meshspeed.") else ""
            if head == "compat" or head in DEEPSPEED_NAMES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert bad == []


def test_the_import_linter_contract_is_kept():
    exe = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(exe), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]

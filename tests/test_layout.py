"""The package's layering: run-time code (the ops, their kernels, the registry, the weight
store they read and the per-call lookup of a graph's FP8 inputs) never imports compile-time
code (the passes, the backend)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fp8compile"
RUN_TIME = [
    *sorted((PACKAGE / "ops").rglob("*.py")),
    PACKAGE / "registry.py",
    PACKAGE / "weights.py",
    PACKAGE / "derived.py",
    PACKAGE / "numerics.py",
]
COMPILE_TIME = ("passes", "backend", "config", "report", "debug")


def _imported(path: Path) -> set[str]:
    """Modules path imports, as dotted names relative to the package (at any depth, lazy ones too)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name.removeprefix("fp8compile.") for name in names if name.startswith("fp8compile")}


def test_run_time_modules_never_import_compile_time_ones():
    offenders = {
        path.name: sorted(name for name in _imported(path) if name.split(".")[0] in COMPILE_TIME)
        for path in RUN_TIME
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_ops_never_import_the_registry_the_config_or_anything_above_them():
    # The registry chooses among the kernels at compile time and installs its lookup in
    # ops/kernels.py; the ops read that table and import nothing from the floors above.
    above = ("registry", "autotune", "config", "passes", "backend", "report", "debug", "bench")
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imported(path) if name.split(".")[0] in above
        )
        for path in sorted((PACKAGE / "ops").rglob("*.py"))
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_layering_check_sees_relative_and_lazy_imports():
    ops = _imported(PACKAGE / "ops" / "moe" / "op.py")
    assert {
        "weights",
        "ops.kernels",
        "ops.activations",
    } <= ops  # `from ...weights import`, `from .. import kernels`, `from .. import activations`
    assert "ops.vendors" in _imported(PACKAGE / "registry.py")  # `from .ops.vendors import` in a function


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules path imports: `from . import reference` is ops.reference, not ops."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = (
                ".".join(base + ([node.module] if node.module else [])).removeprefix("fp8compile").lstrip(".")
            )
            for alias in node.names:
                sub = f"{module}.{alias.name}".lstrip(".")
                found.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("fp8compile").lstrip(".") for alias in node.names}
    return found & modules


def _import_cycles() -> list[list[str]]:
    """Circles in the graph of the package's imports (module level and lazy alike)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: sorted(_imports_of(path, set(modules)) - {name}) for name, path in modules.items()}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            if state.get(target) == 1:
                cycles.append(
                    path[path.index(target) :] + [name, target] if target in path else [name, target]
                )
            elif target not in state:
                visit(target, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def test_no_two_modules_import_each_other_even_lazily():
    assert _import_cycles() == []


def _ruff() -> str | None:
    """The ruff of the environment running the tests (beside its python, also where that
    environment is not activated), else the one on PATH."""
    import shutil
    import sys

    beside = Path(sys.executable).parent / "ruff"
    return str(beside) if beside.exists() else shutil.which("ruff")


def test_the_package_and_its_tests_pass_the_linter():
    # pyproject.toml's [tool.ruff]: pycodestyle errors and warnings, pyflakes, 110 columns.
    import subprocess

    import pytest

    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run(
        [ruff, "check", "fp8compile", "tests"], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_package_and_its_tests_are_laid_out_by_the_formatter():
    # pyproject.toml's [tool.ruff.format]; `ruff format` fixes what this finds.
    import subprocess

    import pytest

    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run(
        [ruff, "format", "--check", "fp8compile", "tests"], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_every_kernel_the_registry_names_by_module_and_function_exists():
    # The registry names most kernels as "module:function" strings, imported on first use: a
    # module moved or a function renamed would fail only when a GPU first asks for that kernel.
    import importlib
    import importlib.util

    from fp8compile import registry

    named = [
        (backend.name, what, target)
        for backend in registry._BACKENDS.values()
        for what, target in [*backend.ops.items(), ("prepare", backend.prepare)]
        if isinstance(target, str)
    ]
    assert len(named) > 30
    missing = []
    for backend, what, target in named:
        module, _, function = target.partition(":")
        name = importlib.util.resolve_name(module, "fp8compile")
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # its package is missing
            spec = None
        if spec is None:
            missing.append(f"{backend} {what}: no module {name}")
            continue
        try:
            loaded = importlib.import_module(name)
        except ImportError:  # the module needs triton, absent here: its file exists, as checked
            continue
        if not callable(getattr(loaded, function, None)):
            missing.append(f"{backend} {what}: {name} has no {function}")
    assert missing == []

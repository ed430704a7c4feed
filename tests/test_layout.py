"""The package's layering: run-time code (the ops, their kernels, the registry, the weight
store they read and the per-call lookup of a graph's FP8 inputs) never imports compile-time
code (the passes, the backend)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fp8compile"
RUN_TIME = [*sorted((PACKAGE / "ops").glob("*.py")), PACKAGE / "registry.py", PACKAGE / "weights.py",
            PACKAGE / "derived.py",
            PACKAGE / "numerics.py"]
COMPILE_TIME = ("passes", "backend", "config", "report", "debug")


def _imported(path: Path) -> set[str]:
    """Modules path imports, as dotted names relative to the package (at any depth, lazy ones too)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name.removeprefix("fp8compile.") for name in names if name.startswith("fp8compile")}


def test_run_time_modules_never_import_compile_time_ones():
    offenders = {path.name: sorted(name for name in _imported(path) if name.split(".")[0] in COMPILE_TIME)
                 for path in RUN_TIME}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_layering_check_sees_relative_and_lazy_imports():
    ops = _imported(PACKAGE / "ops" / "custom.py")
    assert {"weights", "registry", "ops.reference"} <= ops  # `from ..weights import`, `from . import reference`

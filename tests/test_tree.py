"""Rules the tree's own text keeps, checked on every run of the tests."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# A config module's dotted name or alias: inductor_config, torch._inductor.config, dynamo_config,
# torch._functorch.config; as a string target, "torch._inductor.config.<name>".
_CONFIG_TARGET = re.compile(r"(^|[._])config$|\bconfig\.\w+$")


def config_monkeypatches(source: str) -> list[str]:
    """The `monkeypatch.setattr` / `.delattr` calls in source whose target is a config module.

    torch's config modules (Inductor's, Dynamo's, functorch's) keep their values outside the
    module's __dict__. pytest 9.2's monkeypatch reads the old value from __dict__, finds none, and
    undoes the change with delattr, which hides the key for good: every later read of it in the
    process raises AttributeError (162 failures on a fresh machine). Such tests use the config's
    own `config.patch(...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "monkeypatch"
            and node.args
        ):
            continue
        target = node.args[0]
        text = target.value if isinstance(target, ast.Constant) else ast.unparse(target)
        if isinstance(text, str) and _CONFIG_TARGET.search(text):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_monkeypatches_a_config_module():
    found = {path.name: config_monkeypatches(path.read_text()) for path in sorted(TESTS.glob("*.py"))}
    offenders = {name: calls for name, calls in found.items() if calls}
    assert offenders == {}, "use config.patch(...), never monkeypatch, on torch's config modules"


def test_the_config_monkeypatch_check_finds_every_spelling_and_nothing_else():
    bad = """
monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", True)
monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 8)
monkeypatch.delattr(functorch_config, "enable_autograd_cache")
monkeypatch.setattr("torch._inductor.config.max_autotune", True)
"""
    good = """
monkeypatch.setattr(registry, "_BACKENDS", {})
monkeypatch.setattr(fp8compile.passes, "run_passes", spy)
monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
with inductor_config.patch(coordinate_descent_tuning=True):
    pass
"""
    assert [line.split(":")[0] for line in config_monkeypatches(bad)] == [
        "line 2",
        "line 3",
        "line 4",
        "line 5",
    ]
    assert config_monkeypatches(good) == []


# The project speaks of itself by dates and commits, not by the work periods it was written in:
# neither by the word (spelled in two parts here so that this file passes its own check) nor by
# their spelled ordinals ("in the thirty-" "seventh", split here for the same reason).
_TENS = "twent|thirt|fort|fift|sixt|sevent|eight|ninet"
_DIARY_WORD = re.compile(
    "ses"
    + "sion"
    + rf"|\b({_TENS.replace('|', 'y|')}y)-(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)\b"
    + rf"|\b({_TENS.replace('|', 'ieth|')}ieth)\b",
    re.IGNORECASE,
)


def _tracked_files() -> list[Path]:
    """The project's files: what git tracks, or, outside a git checkout, every file but caches."""
    import subprocess

    root = TESTS.parent
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return [root / name for name in listed.stdout.split("\0") if name]
    skip = {".git", "__pycache__", ".pytest_cache", ".whl", ".ruff_cache"}
    return [p for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)]


def diary_words(files: list[Path]) -> list[str]:
    """Where the word appears in a file's name or text (binary files by name only)."""
    found = []
    root = TESTS.parent
    for path in files:
        name = str(path.relative_to(root))
        if _DIARY_WORD.search(name):
            found.append(name)
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if _DIARY_WORD.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    return found


def test_no_file_of_the_project_names_or_mentions_a_work_period_by_the_diary_word_or_an_ordinal():
    files = _tracked_files()
    assert len(files) > 100
    assert diary_words(files) == []


def test_the_diary_word_check_finds_it_and_spelled_ordinals_in_names_and_text_in_any_case(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(f"{__name__}.TESTS", tmp_path / "tests")
    (tmp_path / "tests").mkdir()
    named = tmp_path / ("bench_" + "Ses" + "sion" + "_3.json")
    named.write_text("{}")
    mentioned = tmp_path / "notes.md"
    mentioned.write_text("fine\nin the last " + "SES" + "SION" + " we\n")
    ordinal = tmp_path / "history.md"
    ordinal.write_text("measured in the Forty-" + "sixth\nand in the thirt" + "ieth\n")
    clean = tmp_path / "clean.py"
    clean.write_text("x = 1\n# the first, second and 21st of them; twenty-one rows\n")
    found = diary_words([named, mentioned, ordinal, clean])
    assert [f.split(":")[0] for f in found] == [named.name, mentioned.name, ordinal.name, ordinal.name]


# benchmarks/ holds the raw rows behind the numbers the docs and the code's comments state, one
# file per run cited, named exactly (no globs): a run nobody cites any more leaves the tree.
_DATA_CITATION = re.compile(r"benchmarks/([\w.-]*\w)")


def benchmark_data_mismatches(files: list[Path]) -> tuple[list[str], list[str]]:
    """(files under benchmarks/ that no other file names, names cited that are not there)."""
    root = TESTS.parent
    data = {p.name for p in files if p.relative_to(root).parts[0] == "benchmarks"}
    cited = set()
    for path in files:
        if path.relative_to(root).parts[0] == "benchmarks" or path == Path(__file__).resolve():
            continue  # this file's own examples cite nothing
        try:
            cited.update(_DATA_CITATION.findall(path.read_text()))
        except (UnicodeDecodeError, FileNotFoundError):
            continue
    return sorted(data - cited), sorted(cited - data)


def test_benchmarks_holds_exactly_the_data_that_the_docs_and_comments_cite():
    uncited, missing = benchmark_data_mismatches(_tracked_files())
    assert uncited == [], "benchmarks/ files no doc or comment names: cite them or remove them"
    assert missing == [], "named as data under benchmarks/ but not in the tree"


def test_the_benchmark_data_check_finds_uncited_files_and_missing_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.TESTS", tmp_path / "tests")
    (tmp_path / "benchmarks").mkdir()
    cited, uncited = tmp_path / "benchmarks" / "run_h200.json", tmp_path / "benchmarks" / "old.json"
    cited.write_text("[]")
    uncited.write_text("[]")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("rows: `benchmarks/run_h200.json`. Gone: benchmarks/lost_h100.json.\n")
    assert benchmark_data_mismatches([cited, uncited, doc]) == (["old.json"], ["lost_h100.json"])

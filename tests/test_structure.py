"""The package's shape, checked by reading its source: which module imports which, where imports
sit, how long modules are, and that no function is written twice. Fast, CPU, nothing compiled."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from arfusion.decisions import Fate, Why

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "arfusion"
MAX_LINES = 450
MIN_DUPLICATE_LINES = 6
# Optional third-party libraries a function may import when it needs them (not installed everywhere).
OPTIONAL = {"transformers", "flashinfer", "aiter", "tqdm", "matplotlib"}


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names of the modules `node` imports (for `from x import y`: x, and x.y)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = _module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.multiproc
def test_the_core_imports_nothing_else_of_the_package():
    done = _run("import sys, arfusion.core\n"
                "print(*sorted(m for m in sys.modules if m == 'arfusion' or m.startswith('arfusion.')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["arfusion", "arfusion.core"], done.stdout


@pytest.mark.multiproc
def test_the_package_loads_what_is_used_in_any_order():
    """`import arfusion` loads nothing; a submodule imported first does not hide a public name
    (`arfusion.stats()`), and the ops are registered by whatever needs them."""
    done = _run("import sys\n"
                "import arfusion\n"
                "assert [m for m in sys.modules if m.startswith('arfusion')] == ['arfusion'], sys.modules\n"
                "import arfusion.patterns\n"  # rewrite.py reads torch.ops.arfusion.* at import
                "import arfusion.fusion_pass\n"
                "from arfusion import PassConfig, stats\n"
                "assert arfusion.stats()['fused_sites'] == 0 and stats()['graphs'] == 0\n"
                "arfusion.reset_stats()\n"
                "assert arfusion.inductor_options(PassConfig())\n"
                "assert arfusion.ops.__name__ == 'arfusion.ops' and arfusion.__version__\n"
                "assert not hasattr(arfusion, 'no_such_name')\n")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", [*_sources("arfusion/patterns"), PACKAGE / "reference.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_patterns_and_the_reference_import_no_backend(path):
    found = [name for node in ast.walk(_parse(path)) if isinstance(node, (ast.Import, ast.ImportFrom))
             for name in _imported(path, node) if name == "arfusion.backends" or name.startswith("arfusion.backends.")]
    assert not found, f"{path.relative_to(ROOT)} imports {sorted(set(found))}"


def _local_imports(path: Path) -> list[str]:
    """`file:line module` of each import inside a function, optional libraries aside."""
    found = []
    for func in ast.walk(_parse(path)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                name = _imported(path, node)[0]
                if name.split(".")[0] not in OPTIONAL:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def test_imports_sit_at_the_top_of_modules():
    """No function imports a module (optional libraries aside): a function-local import hides a
    cycle or a slow first call."""
    found = sorted({hit for path in _sources("arfusion") for hit in _local_imports(path)})
    assert not found, "function-local imports:\n" + "\n".join(found)


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in _sources("arfusion", "benchmarks")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _body_key(func: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function as written, its name and docstring left out."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    kind = type(func)
    copy = kind(name="", args=func.args, body=body, decorator_list=func.decorator_list, returns=func.returns,
                type_comment=None, **({"type_params": []} if "type_params" in kind._fields else {}))
    return ast.dump(copy, include_attributes=False)


def test_no_function_is_defined_twice():
    seen: dict[str, list[str]] = {}
    for path in _sources("arfusion", "benchmarks"):
        for func in ast.walk(_parse(path)):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and func.end_lineno - func.lineno + 1 >= MIN_DUPLICATE_LINES:
                seen.setdefault(_body_key(func), []).append(f"{path.relative_to(ROOT)}:{func.lineno} {func.name}")
    twice = [places for places in seen.values() if len(places) > 1]
    assert not twice, "functions defined more than once:\n" + "\n".join(", ".join(p) for p in twice)


# ------------------------------------------------------------------ decisions are values

DRIVER_MAX_LINES = 30  # ArFusionPass._rewrite: find, decide, edit, record, in one screen
# Where a reason or an outcome is held; a prose literal compared with one of these is free text.
HOLDS_A_REASON = re.compile(r"\b(reason|reasons|why_not|not_fused|not_fast|detail|message|outcome|fate)\b")
FATES = {fate.value for fate in Fate}


def _literals(node: ast.expr) -> list[str]:
    """The string literals `node` is, or holds as a tuple or list."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _free_text_comparisons(path: Path) -> list[str]:
    """`file:line source` of each comparison of a reason or outcome with a literal: prose (a
    literal with a space) or an outcome spelled as a string."""
    found = []
    for node in ast.walk(_parse(path)):
        calls = [node] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("startswith", "endswith") else []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif calls:
            operands = [node.func.value, *node.args]
        else:
            continue
        for i, operand in enumerate(operands):
            others = " ".join(ast.unparse(o) for j, o in enumerate(operands) if j != i)
            texts = _literals(operand)
            if texts and HOLDS_A_REASON.search(others) and "getMessage" not in others \
                    and any(" " in t or t in FATES for t in texts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)[:100]}")
                break
    return found


def test_no_reason_or_outcome_is_compared_as_free_text():
    """Codes and fates are compared as values (decisions.Why, decisions.Fate); a message is read
    only for the names and numbers it must carry (a literal without spaces)."""
    decided = {PACKAGE / "decisions.py"}
    found = [hit for path in _sources("arfusion", "benchmarks", "tests", "examples") if path not in decided
             for hit in _free_text_comparisons(path)]
    assert not found, "free-text comparisons of reasons or outcomes:\n" + "\n".join(found)


def test_stats_reasons_are_read_by_code():
    """`stats()["why_not"]` (messages, for people) is never read by a test or a sweep; they read
    `why_not_codes`."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _sources("tests", "benchmarks")
             for node in ast.walk(_parse(path))
             if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
             and node.slice.value in ("why_not", "nccl_reasons")]
    assert not found, "reasons read by message: " + ", ".join(found)


def test_the_driver_reads_in_one_screen():
    tree = _parse(PACKAGE / "fusion_pass.py")
    driver, = (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_rewrite")
    lines = driver.end_lineno - driver.lineno + 1
    assert lines <= DRIVER_MAX_LINES, f"ArFusionPass._rewrite is {lines} lines"


def test_test_modules_import_no_other_test_module():
    """Shared test code lives in tests/helpers.py, tests/models.py and the *_cases.py modules."""
    found = []
    for path in _sources("tests"):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported(path, node)
                hits = [n for n in names[:1] if n.split(".")[-1].startswith("test_")]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in hits]
    assert not found, "test modules imported by other modules:\n" + "\n".join(found)


def test_every_fate_and_code_is_documented():
    """docs/usage.md lists every fate and reason code (people read the codes in stats and JSON)."""
    doc = (ROOT / "docs" / "usage.md").read_text()
    missing = [v.value for v in (*Fate, *Why) if f"`{v.value}`" not in doc]
    assert not missing, f"not in docs/usage.md: {missing}"

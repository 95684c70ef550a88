"""The house's size rules, held by a test so a change that breaks them says so.

A module of the login side (``hpc/``), the compute side (``src/ddp/``) or the package
both share (``src/hpc_ddp/``) stays under ~450 lines, and a function's body (its
docstring aside) under ~60 lines unless its docstring says why it is longer (the words
"60 lines" and the reason): a reader finds a thing by its module's name and reads one
function at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDES = (ROOT / "hpc", ROOT / "src" / "ddp", ROOT / "src" / "hpc_ddp")
MODULE_LINES = 460  # "~450": the formatter's line breaks may add a few
FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for side in SIDES for p in side.rglob("*.py"))


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            if len(body) == 1:
                return 0
            body = body[1:]
    end = node.end_lineno or body[-1].lineno
    return end - body[0].lineno + 1


def test_the_sides_have_modules_to_check() -> None:
    assert len(_modules()) > 50, [str(s) for s in SIDES]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_under_450_lines(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines; split it"


def test_long_functions_say_why() -> None:
    unexplained = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _body_lines(node)
                if n > FUNCTION_LINES and "60 lines" not in (ast.get_docstring(node) or ""):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not unexplained, "over 60 lines, no reason in the docstring: " + "; ".join(unexplained)


def test_the_rule_sees_a_long_function(tmp_path: Path) -> None:
    """The measure itself: a 61-line body counts, its docstring does not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    tree = ast.parse(f'def f():\n    """Doc.\n\n    More."""\n{body}\n')
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert _body_lines(node) == 61

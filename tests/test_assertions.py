"""Assertions that cannot fail, found with ``ast``: a check that passes whatever the code does reports a property
nobody verified (issue 60 found ``assert ... or True`` and an assertion of arithmetic on literals).

Every ``assert`` statement of the test suite and of the package is read. One is flagged when its outcome is fixed
before anything runs:

- a truthy literal in an ``or`` (``assert x or True``), or a test that is itself a truthy literal or a non-empty
  tuple (``assert (x, "message")``, which Python reads as a tuple);
- a comparison whose sides are all literals (``assert pytest.approx(4 / 7) == (8 * 1) / (7 * 2)``).

A literal is a constant, arithmetic, a container or ``approx(...)`` made of literals only; a name, an attribute or
any other call is not (``math.pi`` and ``len(x)`` count as code, so ``assert len(PRESETS) == 3`` stays). An
``assert False`` (always failing) is not flagged: it cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("tests", "lightning_hydra")


def is_literal(node: ast.expr) -> bool:
    """Whether ``node`` evaluates to the same value whatever the code under test does."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    if isinstance(node, ast.BoolOp):
        return all(is_literal(v) for v in node.values)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and is_literal(k) for k in node.keys) and all(is_literal(v) for v in node.values)
    if isinstance(node, ast.Call):  # pytest.approx(literal) or approx(literal), with literal options
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return (
            name == "approx"
            and all(is_literal(a) for a in node.args)
            and all(kw.value is not None and is_literal(kw.value) for kw in node.keywords)
        )
    return False


def _truthy_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Dict):
        return bool(node.keys)  # non-empty: true, whatever it holds
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts)
    if not is_literal(node) or isinstance(node, ast.Call):
        return False
    try:
        return bool(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, MemoryError, RecursionError):
        return False


def why_it_cannot_fail(test: ast.expr) -> str | None:
    """The reason an ``assert test`` passes whatever the code does, or ``None``."""
    if _truthy_literal(test):
        return "its test is always true"
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and any(_truthy_literal(v) for v in test.values):
        return "an `or` with a true literal"
    if isinstance(test, ast.Compare) and is_literal(test.left) and all(is_literal(c) for c in test.comparators):
        return "it compares literals only"
    return None


def vacuous(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: reason`` of every ``assert`` in ``source`` that cannot fail."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Assert):
            reason = why_it_cannot_fail(node.test)
            if reason:
                out.append(f"{filename}:{node.lineno}: {reason}: assert {ast.unparse(node.test)}")
    return out


def test_no_assertion_passes_whatever_the_code_does():
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += vacuous(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "assertions that cannot fail:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'assert "Traceback" in err or True',
        "assert x == 1 or 1",
        "assert True",
        "assert (x, 'it said so')",
        "assert pytest.approx(4 / 7) == (8 * 1) / (7 * 2)",
        "assert approx(0.5, rel=1e-6) == 1 / 2",
        "assert 2 ** 10 == 1024",
        "assert -1 < 0 <= 3",
        "assert (1, 2) == (1, 2)",
        "assert 'a' in 'abc'",
        "assert {'a': 1} == {'a': 1}",
    ],
)
def test_flags_what_cannot_fail(source):
    assert len(vacuous(source)) == 1, source


@pytest.mark.parametrize(
    "source",
    [
        "assert x or y",
        "assert x == 1 or False",  # can fail
        "assert False",  # cannot pass
        "assert not x",
        "assert len(PRESETS) == 3",
        "assert f(4 / 7) == 4 / 7",
        "assert pytest.approx(result) == 4 / 7",
        "assert pytest.approx(4 / 7) == ratio",
        "assert math.pi > 3",
        "assert ()",  # an empty tuple is false: it cannot pass
        "assert a.digest() == a.digest()",  # the same call twice: a determinism check
        "assert sorted(x) == [1, 2]",
    ],
)
def test_leaves_what_can_fail(source):
    assert vacuous(source) == [], source

"""The trainer's shape (issue 45): train/ is setup, loop and checkpoint, and every function in it fits on one screen.

A function over MAX_FUNCTION_LINES lines (decorators and docstring included) fails this test, named with its file
and line: split it where it does two things. The loop itself is `loop.train_run`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import draftsmith.train

TRAIN = Path(draftsmith.train.__file__).parent
MAX_FUNCTION_LINES = 60


def functions(path: Path):
    """(qualified name, first line, length in lines) of every function and method in the file, nested ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                yield f"{prefix}{child.name}", first, child.end_lineno - first + 1
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree)


def test_no_function_in_train_is_longer_than_a_screen():
    long = [f"{path.relative_to(TRAIN.parent.parent)}:{line} {name} ({length} lines)"
            for path in sorted(TRAIN.glob("*.py")) for name, line, length in functions(path)
            if length > MAX_FUNCTION_LINES]
    assert not long, f"functions in train/ over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)


def test_the_length_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"class A:\n    @staticmethod\n    def f():\n{body}\n\n\ndef g():\n    pass\n")
    found = {name: length for name, _, length in functions(tmp_path / "long.py")}
    assert found == {"A.f": MAX_FUNCTION_LINES + 2, "g": 2}


def test_the_loop_and_setup_are_where_the_layout_says():
    from draftsmith.train import Run, TrainingError, train
    from draftsmith.train.loop import train_run
    from draftsmith.train.setup import setup

    assert callable(setup) and callable(train) and callable(train_run)
    assert {"features", "budget", "paths", "method", "drafter"} <= set(Run.__dataclass_fields__)
    assert issubclass(TrainingError, ValueError)


def test_collect_imports_no_private_name_of_the_trainer():
    tree = ast.parse((TRAIN / "collect.py").read_text(encoding="utf-8"))
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if (node.module or "").startswith("draftsmith.train")]
    assert not [name for _, name in imported if name.startswith("_")], imported

"""What Lightning's Trainer takes (its arguments, the values of `precision`), read from Lightning's own source
without importing it, which takes seconds: the command line is checked, and a mistake answered, before torch
and Lightning are imported. tests/test_bad_input.py compares both with what the imported Trainer declares."""

import ast
import importlib.util
from functools import cache
from pathlib import Path


def _parsed(relative: str) -> ast.Module:
    """A module of the installed `lightning` package, parsed; finding the package imports none of it."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lightning is not installed")
    return ast.parse((Path(next(iter(spec.submodule_search_locations))) / relative).read_text())


@cache
def trainer_arguments() -> frozenset[str]:
    """The parameters of `lightning.Trainer.__init__`."""
    tree = _parsed("pytorch/trainer/trainer.py")
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    init = next(node for node in trainer.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return frozenset(arg.arg for arg in [*init.args.args, *init.args.kwonlyargs] if arg.arg != "self")


@cache
def precisions() -> tuple[str, ...]:
    """The values of `Trainer(precision=...)`, in the order of Lightning's `_PRECISION_INPUT`: the Literals of
    the Union it names, each as a command line types it."""
    literals: dict[str, list[str]] = {}
    union: list[str] = []
    for node in _parsed("fabric/plugins/precision/precision.py").body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript) and isinstance(node.value.value, ast.Name)):
            continue
        name, kind = node.targets[0].id, node.value.value.id
        if kind == "Literal":
            literals[name] = [str(c.value) for c in ast.walk(node.value.slice) if isinstance(c, ast.Constant)]
        elif kind == "Union" and name == "_PRECISION_INPUT":
            union = [n.id for n in ast.walk(node.value.slice) if isinstance(n, ast.Name)]
    return tuple(dict.fromkeys(value for name in union for value in literals.get(name, [])))

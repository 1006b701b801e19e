"""Source checks that keep the kernels compiling under the GPU machine's Triton 3.6 as well as
3.8, without installing 3.6: patterns that one version compiles and the other rejects.

Triton 3.6's dependency finder (the AST walk that hashes a jitted function's globals) raises
``TypeError`` the first time a ``@triton.jit`` function holding a nested tuple target
(``a, (b, c) = f()``) compiles; 3.8 and the interpreter accept it, so only a 3.6 compile would
notice."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRITON_DIR = Path(__file__).resolve().parent.parent / "specdec_kernels" / "triton"


def _is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit``, ``@jit``, ``@triton.jit(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    return name == "jit"


def _targets(node: ast.AST) -> list:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.For, ast.comprehension)):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    return []


def nested_tuple_targets(source: str, filename: str = "<source>") -> list[str]:
    """``file:line function`` for every assignment or loop target inside a ``@triton.jit``
    function of ``source`` that unpacks into a nested tuple or list."""
    found = []
    for function in ast.walk(ast.parse(source, filename)):
        if not isinstance(function, ast.FunctionDef) or not any(
                _is_jit(d) for d in function.decorator_list):
            continue
        for node in ast.walk(function):
            for target in _targets(node):
                if isinstance(target, (ast.Tuple, ast.List)) and any(
                        isinstance(element, (ast.Tuple, ast.List)) for element in target.elts):
                    found.append(f"{filename}:{target.lineno} {function.name}")
    return found


def _jit_function_count(source: str) -> int:
    return sum(isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)
               for node in ast.walk(ast.parse(source)))


def test_no_nested_tuple_targets_in_jitted_functions():
    files = sorted(TRITON_DIR.glob("*.py"))
    assert sum(_jit_function_count(path.read_text()) for path in files) > 20  # the walk sees them
    found = [hit for path in files
             for hit in nested_tuple_targets(path.read_text(), path.name)]
    assert found == [], f"nested tuple targets (Triton 3.6 raises TypeError): {found}"


PLANTED = '''
import triton
import triton.language as tl


def host(pairs):
    a, (b, c) = pairs  # host code: not checked
    return a


@triton.jit
def _terms(x):
    return x, (x, x)


@triton.jit
def _kernel(ptr):
    x = tl.load(ptr)
    a, (b, c) = _terms(x)
    for i, (j, k) in zip(a, b):
        pass
    tl.store(ptr, a + b + c)
'''


@pytest.mark.parametrize("planted,expected", [
    (PLANTED, ["<source>:19 _kernel", "<source>:20 _kernel"]),
    (PLANTED.replace("a, (b, c) = _terms(x)", "a, b, c = _terms(x)")
     .replace("for i, (j, k) in", "for i, j in"), []),
])
def test_the_check_catches_a_planted_nested_target(planted, expected):
    assert nested_tuple_targets(planted) == expected

"""Every module global a Triton kernel reads is a `tl.constexpr`: the interpreter (CPU CI) reads any global,
the compiler refuses a plain one (a GELU constant reached the GPU that way). Static: the kernels' source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr in ("jit", "autotune", "heuristics")


def _plain_globals(tree: ast.Module) -> set[str]:
    """Module-level names bound to a literal number (tl.constexpr(...) calls are not literals)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant | ast.UnaryOp):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernels_read_only_constexpr_globals(path: Path) -> None:
    tree = ast.parse(path.read_text())
    plain = _plain_globals(tree)
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any(_is_jit(d) for d in fn.decorator_list):
            local = {a.arg for a in fn.args.args} | {
                n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            bad = sorted((read & plain) - local)
            assert not bad, f"{path.name}:{fn.name} reads plain module globals {bad}: make them tl.constexpr"

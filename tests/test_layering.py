"""The layer rules, read from the source (ast), so an arrow running the wrong way fails CI.

Layers, top to bottom (README's layout table): the public surface; replicas on Ray; the async layer with
input processing (the front side, shared by `AsyncLLMEngine` and `LLM`); the composition root; the engine
core; executors; the worker; structured output; sampling and model loading; models; attention; layers;
kernels.
A module imports its own layer or lower ones, plus the foundation modules every layer shares (errors,
validation, config, outputs, sampling_params, chat templating and the step contract `asyncllm.step`), which
import only each other. The core and the foundation never import torch (or numpy, triton, transformers), not even
lazily; the public surface and the async layer do so only inside functions. No import cycle among
module-level imports.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "asyncllm"
KERNELS = ROOT / "kernels"

LAYERS: list[tuple[str, ...]] = [  # top to bottom; each entry: module prefixes of one layer
    ("asyncllm", "asyncllm.llm", "asyncllm.cli", "asyncllm.console", "asyncllm.default_model", "asyncllm.server"),
    ("asyncllm.ray",),  # replicas on Ray behind the async front (the server's --replicas)
    ("asyncllm.async_engine", "asyncllm.input_processor", "asyncllm.parsing"),  # the front side, below both fronts
    ("asyncllm.build", "asyncllm.startup"),
    ("asyncllm.core",),
    ("asyncllm.executor", "asyncllm.distributed"),
    ("asyncllm.worker",),
    ("asyncllm.structured_output",),  # grammars and their bitmasks: above the sampler, which never imports it
    ("asyncllm.sample", "asyncllm.model_loader"),
    ("asyncllm.models",),
    ("asyncllm.attention",),
    ("asyncllm.layers", "asyncllm.quantization"),  # quantized layers beside the layers they replace
    ("asyncllm.kernels",),
]
FOUNDATION = {
    "asyncllm.chat",
    "asyncllm.envs",  # the ASYNCLLM_* tuning variables
    "asyncllm.env_var",  # how such a variable is declared and parsed
    "asyncllm.errors",
    "asyncllm.input_limits",  # bounds on client input, checked before any tokenizer, template or compiler
    "asyncllm.install",  # the distribution's name and the pip commands error messages print
    "asyncllm.validation",
    "asyncllm.config",
    "asyncllm.config_values",
    "asyncllm.config_device",
    "asyncllm.config_fields",
    "asyncllm.config_speculative",
    "asyncllm.outputs",
    "asyncllm.pooling",  # embed and score engines' plain data: the pooler, a request's options, the results
    "asyncllm.sampling_params",
    "asyncllm.structured",
    "asyncllm.step",  # the step contract between the core and the executors
}
HEAVY = ("torch", "numpy", "triton", "transformers")
# Besides the foundation: never import HEAVY, not even inside a function.
TORCH_FREE = ("asyncllm.core", "asyncllm.parsing")
LAZY_ONLY = (*LAYERS[2], *LAYERS[1], *LAYERS[0])  # may import torch layers only inside functions


def _module_name(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        parts = ["asyncllm", "kernels", *path.relative_to(KERNELS).with_suffix("").parts]
    else:
        parts = ["asyncllm", *path.relative_to(SRC).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*SRC.rglob("*.py"), *KERNELS.rglob("*.py")]
    return {_module_name(p): p for p in files}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    """`module` is one of `prefixes` or inside one (the bare package name "asyncllm" means only itself)."""
    return any(module == p or (p != "asyncllm" and module.startswith(p + ".")) for p in prefixes)


def _rank(module: str) -> int | None:
    """Index of the module's layer (0 = top); None for the foundation."""
    if module in FOUNDATION:
        return None
    best, best_len = -1, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, (prefix,)) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best >= 0, f"{module} belongs to no layer: add it to LAYERS in this test and to README's table"
    return best


class _Imports(ast.NodeVisitor):
    """(imported module, at module level and outside `if TYPE_CHECKING`) for every import in a file."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, bool, bool, int]] = []  # (name, eager, top level, line)
        self._depth = 0  # inside a function
        self._type_checking = 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        guard = ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        self._type_checking += guard
        for child in node.body:
            self.visit(child)
        self._type_checking -= guard
        for child in node.orelse:
            self.visit(child)

    def _add(self, name: str, node: ast.AST) -> None:
        eager = self._depth == 0 and self._type_checking == 0
        self.found.append((name, eager, self._depth == 0, getattr(node, "lineno", 0)))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:  # `from asyncllm.x import y` may name a submodule y
            self._add(f"{base}.{alias.name}", node)


def _imports(module: str, path: Path) -> list[tuple[str, bool, bool, int]]:
    """(imported name, run when the module is imported, outside any function (`TYPE_CHECKING` included), line)."""
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The asyncllm module an import refers to (an imported name resolves to its module), else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


SOURCES = _sources()


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_imports_run_down_the_layers(module: str) -> None:
    rank = _rank(module)
    for name, eager, _, line in _imports(module, SOURCES[module]):
        where = f"{SOURCES[module].relative_to(ROOT)}:{line}"
        top = name.split(".")[0]
        if top in HEAVY:
            if module in FOUNDATION or _within(module, TORCH_FREE):
                raise AssertionError(f"{where}: {module} imports {name}; it must stay free of torch")
            if eager and _within(module, LAZY_ONLY):
                raise AssertionError(f"{where}: {module} imports {name} at import time; import it in a function")
            continue
        target = _resolve(name, SOURCES) if top == "asyncllm" else None
        if target is None or target == module:
            continue
        target_rank = _rank(target)
        if rank is None:
            assert target_rank is None, f"{where}: foundation module {module} imports {target} (a layer)"
        elif target_rank is not None:
            assert target_rank >= rank, f"{where}: {module} imports {target}, a layer above it"
        if eager and _within(module, LAZY_ONLY) and target_rank is not None and target_rank > _rank("asyncllm.core"):
            raise AssertionError(f"{where}: {module} imports the torch layer {target} at import time")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])) is not None:
                return found
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])) is not None:
            return found
    return None


def _graph(keep: Callable[[bool, bool], bool]) -> dict[str, set[str]]:
    return {
        m: {
            t
            for name, eager, top, _ in _imports(m, p)
            if keep(eager, top) and (t := _resolve(name, SOURCES)) and t != m
        }
        for m, p in SOURCES.items()
    }


def test_no_import_cycles() -> None:
    """Among module-level imports (what runs when a module is first imported) there is no cycle."""
    cycle = _cycle(_graph(lambda eager, top: eager))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_circles_counting_type_checking_imports() -> None:
    """Nor among every import outside a function, `if TYPE_CHECKING` ones included: a circle there is two
    modules that each need the other's names, whichever one Python happens to load first (regression: the
    core's request -> sample_group -> block_manager -> request, and sample/'s mask_fill -> request_grammar ->
    state -> structured -> mask_fill)."""
    cycle = _cycle(_graph(lambda eager, top: top))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


MAX_MODULE_LINES = 400  # STYLE.md: split before 400 lines, along a concept


def test_no_module_over_400_lines() -> None:
    """Every module of the package and every kernel file stays under the bound (split along a concept)."""
    files = [*SOURCES.values(), *(ROOT / "kernels").rglob("*.py")]
    over = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them along a concept): {over}"

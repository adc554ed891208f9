"""Shared fixtures: tiny checkpoints are built once per session and reused (read-only) by every test.

Tests marked `needs_structured_output` skip unless the engine enforces output constraints (a probe asks for
`choice=["x"]` on a tiny model): they are written ahead of the constrained-decoding path."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.fixtures.quantized import VARIANTS, build_quantized
from tests.fixtures.tiny_models import FAMILIES, build_checkpoint
from tests.fixtures.triton_interpreter import patch_lang_once_per_launch
from tests.fixtures.triton_kernels import use_interpreter_without_cuda

# Before anything imports triton (transformers does, during collection): see tests/fixtures/triton_kernels.py.
use_interpreter_without_cuda()
if os.environ.get("TRITON_INTERPRET") == "1":
    patch_lang_once_per_launch()  # see tests/fixtures/triton_interpreter.py
# A suite started in the background of a shell without job control (`scripts/test.sh &`) inherits Ctrl-C
# ignored, and so would every process it starts: the Ctrl-C tests then see nothing to stop. Restored here
# (each xdist worker loads this file too); a process started from a Python handler gets the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_structured_output: needs the engine to enforce SamplingParams constraints (else skipped)"
    )
    config.addinivalue_line("markers", "core_process: make_engine also runs the test against a core in its own process")


@pytest.hookimpl(trylast=True)  # after the folders' own hooks have marked their tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with `slow` tests run first, each module's tests still together (its fixtures built once):
    pytest-xdist hands tests out in this order, and seconds-long tests started last would leave one worker
    running alone at the end of the suite."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: the order within a module is kept


@pytest.fixture(scope="session")
def structured_output_enforced(tiny_checkpoints: dict[str, Path]) -> bool:
    """Whether the engine enforces output constraints: a random model asked for one of ["x"] says "x"."""
    from asyncllm import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    try:
        params = SamplingParams(choice=["x"], temperature=1.0, seed=0, max_tokens=8)
        out = llm.generate("Hello", params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return out.text == "x"


@pytest.fixture(autouse=True)
def _no_kept_gemm_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test engines neither read nor keep start-up GEMM choices in the user's cache (worker/tuning_cache.py): each
    times as a first start does. The cache's own tests turn it back on."""
    monkeypatch.setenv("ASYNCLLM_TUNING_CACHE", "0")


@pytest.fixture(autouse=True)
def _skip_unless_structured_output(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("needs_structured_output") is None:
        return
    if not request.getfixturevalue("structured_output_enforced"):
        pytest.skip("the engine does not enforce output constraints yet")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family name -> checkpoint directory, built lazily the first time each is asked for."""
    root = tmp_path_factory.mktemp("ckpt")

    class _Lazy(dict):
        def __missing__(self, family: str) -> Path:
            path = build_checkpoint(root / family, family)
            self[family] = path
            return path

    return _Lazy()


@pytest.fixture(scope="session")
def tiny_lora_adapters(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name (a key of tests/fixtures/lora_adapters.ADAPTERS) -> a PEFT adapter directory for the tiny Qwen3
    checkpoint, built lazily the first time each is asked for."""
    from tests.fixtures.lora_adapters import ADAPTERS, build_adapter

    root = tmp_path_factory.mktemp("lora")

    class _Lazy(dict):
        def __missing__(self, name: str) -> Path:
            seed, config = ADAPTERS[name]
            path = build_adapter(root / name, tiny_checkpoints["qwen3"], seed, **config)
            self[name] = path
            return path

    return _Lazy()


@pytest.fixture(scope="session")
def quantized_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict]]:
    """variant (tests/fixtures/quantized.py VARIANTS) -> (quantized checkpoint in a hub's layout, its float
    twin holding the dequantized weights, {weight name: intended float32 weight}), built on first use."""
    root = tmp_path_factory.mktemp("quantized")

    class _Lazy(dict):
        def __missing__(self, name: str) -> tuple[Path, Path, dict]:
            fmt, options = VARIANTS[name]
            built = build_quantized(root / name, fmt, **options)
            self[name] = built
            return built

    return _Lazy()


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoints: dict[str, Path]) -> Path:
    """The default tiny model (Qwen3 family) for engine and async tests."""
    return tiny_checkpoints["qwen3"]


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """float32 matmuls on CUDA in full IEEE precision (no TF32) for one test, the process's setting restored
    after it: tests that compare float32 runs token for token need both sides rounded the same way. Use it
    explicitly (`@pytest.mark.usefixtures("exact_fp32")`); no test flips the switch for the whole session."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous

"""`DeviceConfig`: where and how the model executes (device, threads, attention backend, CUDA graphs, the
core's process). One part of `EngineConfig` (config.py), split out for size;
every field validated at construction with an `InvalidConfigError` naming it. Plain Python; no torch. The
decode kernels' switches, the graphs' tuning and where the grammar matchers live are not engine arguments:
`asyncllm.envs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm import envs
from asyncllm.config_fields import arg, from_env, invalid, set_field
from asyncllm.config_values import AttentionBackendName, Device
from asyncllm.validation import check_bool, check_enum, check_float, check_optional_int

# A constraint compiling longer than this fails its request: far above a real schema's compile (milliseconds to a
# few seconds on a 150k-token vocabulary), bounding what one crafted constraint can take.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 30.0


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """Where and how the model executes."""

    device: Device = arg(Device.AUTO, '"auto" takes CUDA when present, else CPU.')
    attention_backend: AttentionBackendName = arg(
        AttentionBackendName.AUTO,
        '"torch" (the pure-PyTorch reference), "triton" (paged Triton kernels), or "auto" (Triton on CUDA when '
        "installed, else torch).",
    )
    enforce_eager: bool = arg(False, "Never capture CUDA graphs.")
    max_step_seconds: float = from_env(envs.MAX_STEP_SECONDS)  # not an argument: ASYNCLLM_MAX_STEP_SECONDS
    core_process: bool = arg(
        False,
        "Run the engine core (scheduling, detokenizing, the model) in a process of its own, fed through pipes, "
        "so its Python work shares no GIL with the event loops that stream its outputs (a server's HTTP work). "
        "False: a step thread in this process (the default; for embedding). AsyncLLMEngine only.",
    )
    grammar_compile_timeout: float = arg(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        "Seconds a request's output constraint may take to compile (its wait for a compile thread included): "
        "past it the request fails with GrammarCompileTimeoutError and its compile is dropped. Compiles run "
        "beside each other, never in front of requests that need none. AsyncLLMEngine only.",
    )
    num_threads: int | None = arg(
        None,
        "torch's CPU threads for the model's ops (per rank under tensor parallelism), set in the thread that "
        "runs steps (torch.set_num_threads: threads started later inherit it). None: on CPU, the physical cores "
        "this process may use less one (at least 1), shared among the ranks; on CUDA, torch's default.",
    )

    def __post_init__(self) -> None:
        set_field(self, "device", check_enum(invalid, Device, "device", self.device))
        check_optional_int(invalid, "num_threads", self.num_threads, "an integer >= 1, or None", lo=1)
        backend = check_enum(invalid, AttentionBackendName, "attention_backend", self.attention_backend)
        set_field(self, "attention_backend", backend)
        check_bool(invalid, "enforce_eager", self.enforce_eager)
        check_bool(invalid, "core_process", self.core_process)
        seconds = check_float(
            invalid, "max_step_seconds", self.max_step_seconds, "a positive number of seconds", lo=0.0, lo_open=True
        )
        set_field(self, "max_step_seconds", seconds)
        given = self.grammar_compile_timeout
        timeout = check_float(
            invalid, "grammar_compile_timeout", given, "a positive number of seconds", lo=0.0, lo_open=True
        )
        set_field(self, "grammar_compile_timeout", timeout)


def device_limits(max_step_seconds: float | None, grammar_compile_timeout: float) -> DeviceConfig:
    """The front's two bounds checked as the engine's are (`from_builder`, `from_client`): None takes
    ASYNCLLM_MAX_STEP_SECONDS."""
    if max_step_seconds is None:
        return DeviceConfig(grammar_compile_timeout=grammar_compile_timeout)
    return DeviceConfig(grammar_compile_timeout=grammar_compile_timeout, max_step_seconds=max_step_seconds)

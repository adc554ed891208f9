"""Resolving the user's device and dtype choices into torch objects, and the checkpoint's config into its
architecture and quantization, with the tuning variables the workers build with: `ResolvedModel`, made once
per engine. Knows nothing of loading or running the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.config_values import Device, DType, KVCacheDType
from asyncllm.errors import DeviceError, InvalidConfigError
from asyncllm.models.config import ModelArchConfig
from asyncllm.pooling import PoolerSpec
from asyncllm.quantization.scheme import QuantScheme, resolve_quantization
from asyncllm.worker.tuning import WorkerTuning

_DTYPES = {DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16, DType.FLOAT32: torch.float32}


def resolve_device(choice: Device) -> torch.device:
    if choice is Device.CPU:
        return torch.device("cpu")
    if choice is Device.CUDA and not torch.cuda.is_available():
        raise DeviceError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    if choice is Device.CUDA or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_kv_cache_dtype(choice: KVCacheDType, dtype: torch.dtype) -> torch.dtype:
    """What the KV cache stores: the activations' dtype ("auto"), or e4m3 codes ("fp8", "fp8_e4m3")."""
    return dtype if choice is KVCacheDType.AUTO else torch.float8_e4m3fn


def resolve_dtype(choice: DType, device: torch.device, hf_config: Any) -> torch.dtype:
    """ "auto": float32 on CPU (exact and fast there); on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
    if choice is not DType.AUTO:
        return _DTYPES[choice]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass(frozen=True)
class ResolvedModel:
    """The engine's device, dtype, architecture and tuning, resolved once (by the executor) and passed down to
    every worker; picklable, for tensor-parallel worker processes (each takes its own device: `on`)."""

    device: torch.device
    dtype: torch.dtype
    arch: ModelArchConfig
    kv_cache_dtype: torch.dtype  # the activations' dtype, or float8_e4m3fn (kv_cache_dtype="fp8")
    tuning: WorkerTuning  # the ASYNCLLM_* variables as the executor read them: every rank builds alike
    quant: QuantScheme | None = None  # None: unquantized linear layers

    @classmethod
    def resolve(cls, config: EngineConfig, hf_config: Any, pooler: PoolerSpec | None = None) -> ResolvedModel:
        mc = config.model_config
        device = resolve_device(config.device_config.device)
        dtype = resolve_dtype(mc.dtype, device, hf_config)
        arch = ModelArchConfig.from_hf(hf_config, mc.max_model_len, pooler.max_seq_length if pooler else None)
        requested = None if mc.quantization is None else mc.quantization.value
        qc = getattr(hf_config, "quantization_config", None)
        quant = resolve_quantization(requested, qc, device.type, device.type == "cpu" and cpu_int4_chosen())
        kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, dtype)
        return cls(device, dtype, arch, kv_cache_dtype, WorkerTuning.read(config), quant)

    def on(self, device: torch.device) -> ResolvedModel:
        """The same model on another device (a tensor-parallel rank's)."""
        return dataclasses.replace(self, device=device)


def cpu_int4_chosen() -> bool:
    """ASYNCLLM_CPU_INT4: whether quantized weights run from torch's CPU int4 kernel on this CPU."""
    from asyncllm.quantization import cpu_int4

    return envs.CPU_INT4.get() is envs.CpuInt4.AUTO and cpu_int4.supported()


def check_pdl(device: torch.device, triton_backend: bool) -> None:
    """ASYNCLLM_DECODE_PDL=1 needs the Triton kernels on a CUDA device that has programmatic dependent launch
    (compute capability 9.0 or newer)."""
    name = envs.DECODE_PDL.name
    if not triton_backend or device.type != "cuda":
        raise InvalidConfigError(
            f"{name}=1 launches the Triton backend's kernels on CUDA; this engine runs on {device} with "
            f"{'the Triton' if triton_backend else 'the torch'} backend: unset {name}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise InvalidConfigError(
            f"{name}=1 needs compute capability 9.0 or newer (Hopper); {torch.cuda.get_device_name(device)} "
            f"has {major}.{minor}: unset {name}"
        )


def check_layer_prefetch(device: torch.device, decode_layer: bool, prefetch: envs.DecodeLayerPrefetch) -> None:
    """With ASYNCLLM_DECODE_LAYER, ASYNCLLM_DECODE_LAYER_PREFETCH's explicit modes ask L2 through PTX: CUDA, and
    the copy engine's (bulk, ahead) compute capability 9.0 or newer."""
    name, mode = envs.DECODE_LAYER_PREFETCH.name, prefetch.value
    if not decode_layer or prefetch in (envs.DecodeLayerPrefetch.AUTO, envs.DecodeLayerPrefetch.OFF):
        return
    if device.type != "cuda":
        raise InvalidConfigError(f"{name}={mode} asks a CUDA device's L2; this engine runs on {device}: unset {name}")
    major, minor = torch.cuda.get_device_capability(device)
    if prefetch in (envs.DecodeLayerPrefetch.BULK, envs.DecodeLayerPrefetch.AHEAD) and major < 9:
        raise InvalidConfigError(
            f"{name}={mode} uses Hopper's copy engine (compute capability 9.0 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use lines or auto"
        )

"""The CPU decode step's small ops in C (cpu_decode_ops.c), compiled on first use with the machine's C compiler and
kept in a cache directory the caller names, keyed by the source, the compiler and the CPU: `load` returns the ops,
or None where no compiler builds them (the caller then keeps torch's ops, the twin: cpu_decode_ops_ref.py).

`CpuDecodeOps` has a checked method per op taking tensors (what tests and one-off callers use) and `lib`, the
functions themselves, for a step loop that checked its buffers once. Knows nothing of models.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("asyncllm")

SOURCE = Path(__file__).with_name("cpu_decode_ops.c")
# Sums reassociated (so the vectorizer takes them) and expf without errno; never -ffast-math, whose start-up code
# would set flush-to-zero for the whole process.
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
NATIVE = ("-march=native",)  # tried first; dropped where the compiler does not take it

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "asl_add_rms_norm": [_P, _I, _I, _P, _P, _F, _L, _L, _P, _I],
    "asl_rope_kv_write": [_P, _I, _P, _L, _L, _L, _L, _P, _P, _P, _P, _P, _P],
    "asl_decode_attention": [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _F, _P, _I, _P],
    "asl_silu_mul": [_P, _I, _L, _L, _P, _I],
    "asl_quantize_rows_q8": [_P, _L, _L, _P, _P],
    "asl_q8_head": [_P, _P, _P, _P, _L, _L, _L, _P, _L, _L],
}
F32, BF16 = 1, 2  # a row's kind, as the C code reads it


def attention_scratch(group: int, seq_len: int, head_dim: int) -> int:
    """Floats `asl_decode_attention` works in: scores, sums and maxima of one KV head's `group` query heads."""
    return group * (seq_len + head_dim + 2)


def kind(t: torch.Tensor) -> int:
    if t.dtype == torch.float32:
        return F32
    if t.dtype == torch.bfloat16:
        return BF16
    raise TypeError(f"expected a float32 or bfloat16 tensor, got {t.dtype}")


def planes_of(out: torch.Tensor, n: int) -> int:
    """How many times an output row holds its `n` values: 0 for float32 (once), else bfloat16 copies."""
    if out.dtype == torch.float32 and out.shape[-1] == n:
        return 0
    if out.dtype == torch.bfloat16 and out.shape[-1] % n == 0 and out.shape[-1] // n >= 1:
        return out.shape[-1] // n
    raise ValueError(f"out must be float32 [.., {n}] or bfloat16 [.., planes * {n}], got {out.dtype} {out.shape}")


def _contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")


class CpuDecodeOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, add: bool
    ) -> None:
        """residual [T, K] float32 = x (+ residual where `add`); out = rms_norm(residual) * weight (`planes_of`)."""
        _contiguous(x=x, residual=residual, weight=weight, out=out)
        t, k = residual.shape
        if residual.dtype != torch.float32 or x.shape != (t, k) or weight.shape != (k,) or out.shape[0] != t:
            shapes = f"x {tuple(x.shape)}, residual {tuple(residual.shape)}"
            raise ValueError(f"{shapes}: expected x and a float32 residual [T, K], weight [{k}], out [{t}, ..]")
        if weight.dtype != torch.float32:
            raise TypeError("weight must be float32")
        self.lib.asl_add_rms_norm(
            x.data_ptr(), kind(x), int(add), residual.data_ptr(), weight.data_ptr(), eps, t, k, out.data_ptr(),
            planes_of(out, k),
        )  # fmt: skip

    def rope_kv_write(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
        bias: torch.Tensor | None,  # [(Hq + 2 Hkv) D] float32
        cos: torch.Tensor,  # [T, D / 2] float32
        sin: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
        q_out: torch.Tensor,  # [T, Hq, D] float32
        k_rows: torch.Tensor,  # [slots, Hkv, D] float32
        v_rows: torch.Tensor,
    ) -> None:
        _contiguous(qkv=qkv, cos=cos, sin=sin, slots=slots, q_out=q_out, k_rows=k_rows, v_rows=v_rows)
        t, hq, d = q_out.shape
        hkv = k_rows.shape[1]
        if qkv.shape != (t, (hq + 2 * hkv) * d) or cos.shape != (t, d // 2) or sin.shape != cos.shape:
            raise ValueError(f"qkv {tuple(qkv.shape)} / cos {tuple(cos.shape)} against q_out {tuple(q_out.shape)}")
        if v_rows.shape != k_rows.shape or k_rows.shape[2] != d or slots.shape != (t,) or slots.dtype != torch.int64:
            raise ValueError("k_rows and v_rows must be [slots, Hkv, D] alike, slots [T] int64")
        if bias is not None:
            _contiguous(bias=bias)
            if bias.shape != (qkv.shape[1],) or bias.dtype != torch.float32:
                raise ValueError(f"bias must be float32 [{qkv.shape[1]}]")
        dtypes = (cos.dtype, sin.dtype, q_out.dtype, k_rows.dtype, v_rows.dtype)
        if any(dt != torch.float32 for dt in dtypes):
            raise TypeError("cos, sin, q_out and the caches must be float32")
        if t and (int(slots.min()) < 0 or int(slots.max()) >= k_rows.shape[0]):
            raise IndexError(f"a slot outside the cache's {k_rows.shape[0]} rows")
        self.lib.asl_rope_kv_write(
            qkv.data_ptr(), kind(qkv), None if bias is None else bias.data_ptr(), t, hq, hkv, d, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), q_out.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(),
        )  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] float32
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [>= T, max_blocks] int32
        seq_len: int,
        scale: float,
        out: torch.Tensor,  # [T, Hq * D] float32, or bfloat16 [T, planes * Hq * D]
    ) -> None:
        _contiguous(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
        t, hq, d = q.shape
        num_blocks, block_size, hkv, _ = k_cache.shape
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != d or hkv == 0 or hq % hkv:
            raise ValueError(f"caches {tuple(k_cache.shape)} against q {tuple(q.shape)}")
        if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
            raise TypeError("q and the caches must be float32")
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int32 [B, max_blocks] with contiguous rows")
        needed = -(-seq_len // block_size)
        if block_tables.shape[0] < t or block_tables.shape[1] < needed or seq_len < 1:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} cannot hold {t} rows of {seq_len} keys")
        used = block_tables[:t, :needed]
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise IndexError(f"a block outside the cache's {num_blocks}")
        scratch = torch.empty(attention_scratch(hq // hkv, seq_len, d), dtype=torch.float32)
        self.lib.asl_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            seq_len, block_size, t, hq, hkv, d, scale, out.data_ptr(), planes_of(out, hq * d), scratch.data_ptr(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate) * up of gate_up [T, 2 I] (float32 or bfloat16), as `planes_of` lays it."""
        _contiguous(gate_up=gate_up, out=out)
        t, width = gate_up.shape
        if width % 2 or out.shape[0] != t:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} against out {tuple(out.shape)}")
        inter = width // 2
        self.lib.asl_silu_mul(gate_up.data_ptr(), kind(gate_up), t, inter, out.data_ptr(), planes_of(out, inter))

    def q8_head(self, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 against 8-bit codes [V, K] (in [-127, 127]) with float32 scales [V, K / 32]: the
        logits [T, V], x quantized to 8 bits per 32 values (`q8_head_ref`). One thread, every output."""
        _contiguous(codes=codes, scales=scales, x=x)
        v, k = codes.shape
        if codes.dtype != torch.int8 or k % 32 or scales.shape != (v, k // 32) or scales.dtype != torch.float32:
            raise ValueError("codes must be int8 [V, K] (K a multiple of 32) with float32 scales [V, K / 32]")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be float32 [T, {k}], got {x.dtype} {tuple(x.shape)}")
        xq, sx = self.quantize_rows(x)
        out = torch.empty(x.shape[0], v, dtype=torch.float32)
        self.lib.asl_q8_head(codes.data_ptr(), scales.data_ptr(), xq.data_ptr(), sx.data_ptr(), x.shape[0], k, v,
                             out.data_ptr(), 0, v)  # fmt: skip
        return out

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, K] float32 (contiguous, K a multiple of 32) as int8 codes [T, K] and scales [T, K / 32]."""
        t, k = x.shape
        xq, sx = torch.empty(t, k, dtype=torch.int8), torch.empty(t, k // 32, dtype=torch.float32)
        self.lib.asl_quantize_rows_q8(x.data_ptr(), t, k, xq.data_ptr(), sx.data_ptr())
        return xq, sx


def load(cache_dir: Path) -> CpuDecodeOps | None:
    """The compiled ops, built into `cache_dir` the first time on this machine; None (with a warning) where no C
    compiler is found or none builds them."""
    cc = os.environ.get("CC")  # may carry a wrapper or flags: "ccache gcc"
    compiler = shlex.split(cc) if cc else next(([c] for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not compiler:
        logger.warning("no C compiler (cc, gcc, clang or $CC) found: the CPU decode step keeps torch's small ops")
        return None
    source = SOURCE.read_bytes()
    for flags in ((*FLAGS, *NATIVE), FLAGS):
        path = cache_dir / f"cpu_decode_ops-{_identity(compiler, flags, source)}.so"
        if not path.exists() and not _compile(compiler, flags, path):
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            logger.debug("loading %s failed: %s", path, e)
            continue  # e.g. built for another CPU: the plain build next
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        return CpuDecodeOps(lib)
    named = " ".join(compiler)
    logger.warning("%s could not build %s: the CPU decode step keeps torch's small ops", named, SOURCE.name)
    return None


def _identity(compiler: list[str], flags: tuple[str, ...], source: bytes) -> str:
    """A name for the build: the source, the flags, the compiler's version and this CPU (-march=native code may
    not run on another one sharing the directory)."""
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    named = " ".join((*compiler, *flags)).encode()
    digest = hashlib.sha256(source + named + version + _cpu_facts().encode())
    return digest.hexdigest()[:20]


def _cpu_facts() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compile(compiler: list[str], flags: tuple[str, ...], path: Path) -> bool:
    """Build the library at `path` through a temporary file in its directory (a concurrent build never leaves a
    half-written one there)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        logger.warning("cannot write the CPU decode ops under %s: %s", path.parent, e)
        return False
    try:
        cmd = [*compiler, *flags, "-o", tmp, str(SOURCE), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            logger.debug("%s failed: %s", " ".join(cmd), proc.stderr.strip()[-500:])
            return False
        os.replace(tmp, path)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("building %s failed: %s", path.name, e)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

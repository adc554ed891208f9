"""Tuning knobs that are not engine arguments: `ASYNCLLM_*` environment variables, each declared here once
with its type, default and meaning, and read when it is used (never at import), so a test or a benchmark
that sets one affects the engines it makes next. Users should need none of them; a bad value fails where
it is read, naming the variable and the values it takes (env_var.py: how a variable is declared and parsed).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Any

from asyncllm.env_var import (
    EnvVar,
    count,
    count_or_auto,
    flag,
    gib_or_auto,
    ms_or_off,
    one_of,
    positive,
    positive_or_auto,
    seconds,
)


def cache_home() -> Path:
    """asyncllm's own cache directory: $XDG_CACHE_HOME/asyncllm, else ~/.cache/asyncllm (the default model's
    wheels, the kept GEMM choices)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncllm"


def grammar_slow_fill_s() -> float | None:
    """`GRAMMAR_SLOW_FILL_MS` in seconds (None: off)."""
    ms = GRAMMAR_SLOW_FILL_MS.get()
    return None if ms is None else ms / 1000


class DecodeGemv(str, enum.Enum):
    """When a dense linear layer takes the one-launch GEMV at one token row (`DECODE_GEMV`)."""

    AUTO = "auto"  # with CUDA graphs, per layer shape, where it timed faster than cuBLAS at start-up
    ON = "on"  # every layer it can run (the Triton backend): the fast path's test switch
    OFF = "off"  # never, quantized layers' GEMV included: F.linear (and their split-K GEMM) everywhere


class DecodeLayerPrefetch(str, enum.Enum):
    """How the one-launch decode layer asks L2 for its weights (`DECODE_LAYER_PREFETCH`; the kernel's modes,
    kernels/decode_layer_plan.py's PREFETCH_MODES)."""

    AUTO = "auto"  # the measured default: off (no mode has won yet)
    OFF = "off"
    LINES = "lines"  # the whole layer at the launch's start, a line a request
    BULK = "bulk"  # each program's own tiles at the start, through the copy engine (Hopper)
    AHEAD = "ahead"  # bulk's, the MLP's once qkv is read, and the next layer's qkv during the MLP (Hopper)


class GrammarProcessChoice(str, enum.Enum):
    """Where structured output's matchers live (`GRAMMAR_PROCESS`)."""

    AUTO = "auto"  # a process of their own on CUDA with one rank, started at the first constrained request
    ON = "on"  # a process of their own on any device, started with the engine
    OFF = "off"  # the step thread (the twin)


class CudaGraphCapture(str, enum.Enum):
    """When the CUDA graphs are captured (`CUDA_GRAPH_CAPTURE`)."""

    START = "start"  # every bucket's at start-up
    LAZY = "lazy"  # the largest of each kind at start-up, every other while idle or at the first step needing it


class CascadeAttention(str, enum.Enum):
    """When decode steps read a shared prompt prefix once per group (`CASCADE_ATTENTION`)."""

    AUTO = "auto"  # on CUDA with the Triton backend
    ON = "on"  # with the Triton backend on any device (its CPU interpreter too): the fast path's test switch
    OFF = "off"  # never: every decode sequence reads all its keys itself


class CpuInt4(str, enum.Enum):
    """Whether quantized weights run from torch's CPU int4 kernel (`CPU_INT4`)."""

    AUTO = "auto"  # where the CPU computes bfloat16 natively (AVX512-BF16 or AMX)
    OFF = "off"  # never: GGUF files dequantized to float32 at load, other schemes on the reference matmul (the twin)


class CpuDecode(str, enum.Enum):
    """Whether a CPU decode step of a Llama-family model takes models/cpu_decode.py (`CPU_DECODE`)."""

    AUTO = "auto"  # a float32 model on CPU whose every layer that path reproduces
    OFF = "off"  # never: the modules' own forward (the twin)


class CpuNative(str, enum.Enum):
    """Whether that path's int4 layers run their small ops in C (`CPU_NATIVE`)."""

    AUTO = "auto"  # where a C compiler builds kernels/cpu_decode_ops.c (once per machine, kept in the cache)
    OFF = "off"  # never: torch's eager ops between the projections (the twin)


class KvDiskReader(str, enum.Enum):
    """Where the disk tier's reads run (`KV_DISK_READER`)."""

    PROCESS = "process"  # a process of their own over the host slots' shared memory (Linux), else threads
    THREADS = "threads"  # threads of the engine's process, beside the step thread under one GIL


DEAD_ENGINE_JOIN_S: EnvVar[float] = EnvVar(
    "ASYNCLLM_DEAD_ENGINE_JOIN_S",
    6.0,
    seconds,
    "seconds a dead engine's shutdown waits for its step thread to release the device before leaving it "
    "(a kernel stuck on a dead tensor-parallel peer can block that release for good); above the executor's "
    "own bound on the release (3 s) plus its stop of the workers (1 s)",
)

# Read where an engine is configured (its config part's default), so the core's process and every rank see
# the value of the process that made the engine. Until wave four's issues 43/44 they were engine arguments of the
# same names in lower case: the twin switch and two bounds no user should need, making room for `task`,
# `kv_offloading_size` and `kv_cache_dir` under the 30-argument cap.
ASYNC_SCHEDULING: EnvVar[bool] = EnvVar(
    "ASYNCLLM_ASYNC_SCHEDULING",
    True,
    flag,
    "plan step N+1 and process step N-1's outputs while the device runs step N (overlapped scheduling); false "
    "waits for each step before planning the next (the serial twin: the same tokens)",
)
MAX_STEP_SECONDS: EnvVar[float] = EnvVar(
    "ASYNCLLM_MAX_STEP_SECONDS",
    20.0,
    seconds,
    "a step running longer than this makes check_health() (and the server's /health) fail: a stuck device or "
    "kernel (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S). Far above any real step (a GPU step takes milliseconds, "
    "a long CPU prefill a few seconds). AsyncLLMEngine and the server only",
)
CPU_KVCACHE_SPACE: EnvVar[float | None] = EnvVar(
    "ASYNCLLM_CPU_KVCACHE_SPACE",
    None,
    gib_or_auto,
    "the KV cache's budget on CPU in GiB when `num_kv_blocks` is not given (vLLM's VLLM_CPU_KVCACHE_SPACE). "
    "auto: room for one max_model_len sequence (shorter ones share it), at least 1/4 GiB and at most 1 GiB. "
    "Memory becomes resident only as blocks are first written",
)

# The model's build on every rank (read once per engine where the model is resolved, the same for all ranks).
DECODE_GEMV: EnvVar[DecodeGemv] = EnvVar(
    "ASYNCLLM_DECODE_GEMV",
    DecodeGemv.AUTO,
    one_of(DecodeGemv),
    "at one token row (batch-1 decode), dense linear layers with the Triton backend run a one-launch GEMV "
    "instead of cuBLAS, and the op before a layer (RMSNorm with the residual add, SiLU-and-mul) folds into "
    "that GEMV: auto (with CUDA graphs, for each layer shape, and each pair, that timed faster at start-up), "
    "on (every layer and pair it can run, eager or graphed: the fast path's test switch), off (never, the "
    "quantized layers' GEMV included)",
)
DECODE_PDL: EnvVar[bool] = EnvVar(
    "ASYNCLLM_DECODE_PDL",
    False,
    flag,
    "launch the decode chain's Triton kernels (the GEMV and its folded ops, RMSNorm, the q/k norm + rotary + "
    "KV write, the decode attention) as programmatic dependent launches, each overlapping the previous "
    "kernel's tail, CUDA graphs included; a GEMV whose weight fits half the L2 asks for it before it waits; "
    "results unchanged. CUDA on Hopper or newer with the Triton backend only (refused otherwise)",
)
DECODE_LAYER: EnvVar[bool] = EnvVar(
    "ASYNCLLM_DECODE_LAYER",
    False,
    flag,
    "one-row decode steps run each dense Llama/Qwen3 decoder layer as one persistent Triton launch "
    "(kernels/decode_layer.py) instead of its chain of kernels; the Triton backend, layers without LoRA, "
    "quantization, tensor parallelism, sliding windows or an FP8 cache. Off by default: not yet faster",
)
DECODE_LAYER_PREFETCH: EnvVar[DecodeLayerPrefetch] = EnvVar(
    "ASYNCLLM_DECODE_LAYER_PREFETCH",
    DecodeLayerPrefetch.AUTO,
    one_of(DecodeLayerPrefetch),
    "with ASYNCLLM_DECODE_LAYER, how each launch asks L2 for its layer's weights before its phases read them: "
    "auto (the measured default: off, as no mode has won on an H100 yet), off, lines (the whole "
    "layer at the start, a 128-byte line a request), bulk (each program's own tiles at the start through the "
    "copy engine; Hopper or newer), ahead (bulk's qkv tiles at the start, the rest and the attention's keys "
    "once they are read, the next layer's qkv during the MLP; Hopper or newer); results unchanged",
)
DECODE_FOLD_REDUCE: EnvVar[bool] = EnvVar(
    "ASYNCLLM_DECODE_FOLD_REDUCE",
    True,
    flag,
    "the Triton decode attention merges a sequence's KV splits inside its split kernel (the last split to "
    "finish merges: one launch a layer) instead of in a second reduce launch; false: the reduce launch, the "
    "simple twin (results equal to rounding). Cascade decode's merge is the reduce launch either way",
)
CASCADE_ATTENTION: EnvVar[CascadeAttention] = EnvVar(
    "ASYNCLLM_CASCADE_ATTENTION",
    CascadeAttention.AUTO,
    one_of(CascadeAttention),
    "cascade decode attention (Triton backend): decode sequences whose KV blocks begin with the same prefix "
    "(128 tokens or more) read it once per group and step, merged exactly with each one's own keys: auto (on "
    "CUDA), on (also in Triton's CPU interpreter, for tests; refused with attention_backend='torch'), off "
    "(never). Decode-only steps and global-attention layers only",
)
CUDA_GRAPH_SAMPLING: EnvVar[bool] = EnvVar(
    "ASYNCLLM_CUDA_GRAPH_SAMPLING",
    False,
    flag,
    "decode steps replayed from CUDA graphs run the LM head inside the graph and, when every row's token is "
    "the plain draw (temperature or greedy, no filters, penalties, logprobs, min_tokens masks or constraints), "
    "the draw and the record of each request's latest token in a small graph replayed right after; other "
    "steps sample eagerly from the graph's logits. The same tokens either way in float32 (in bfloat16 one GPU "
    "test finds overlapped and serial scheduling apart with it on: docs/tuning.md); no effect without CUDA graphs",
)
CUDA_GRAPH_MAX_TOKENS: EnvVar[int | None] = EnvVar(
    "ASYNCLLM_CUDA_GRAPH_MAX_TOKENS",
    None,
    count_or_auto,
    "steps that are not decode-only (prompt chunks, alone or beside decodes) of up to this many tokens replay "
    "CUDA graphs captured per token count (padded up by at most a quarter); larger steps run eagerly. 0: "
    "decode steps only; auto: 2048, or max_num_seqs plus the prefill cap when that is larger (so capped steps "
    "replay graphs). Each count costs a capture at start-up; the largest sets the graphs' memory",
)
CUDA_GRAPH_CAPTURE: EnvVar[CudaGraphCapture] = EnvVar(
    "ASYNCLLM_CUDA_GRAPH_CAPTURE",
    CudaGraphCapture.START,
    one_of(CudaGraphCapture),
    "when the CUDA graphs are captured: start (every batch size and token count at start-up), lazy (the "
    "largest of each at start-up, which sets the graphs' memory; every other by an async engine while it "
    "idles, one at a time, or by the first step that needs it, which runs eagerly and then records its graph: "
    "start-up is shorter, and that one step longer). One rank only: with tensor parallelism every graph is "
    "captured at start-up",
)
GRAMMAR_PROCESS: EnvVar[GrammarProcessChoice] = EnvVar(
    "ASYNCLLM_GRAMMAR_PROCESS",
    GrammarProcessChoice.AUTO,
    one_of(GrammarProcessChoice),
    "where structured output's grammar matchers live: in a process of their own, which takes each step's "
    "tokens and fills the next token masks beside the step thread, or in the step thread. auto: the process "
    "on CUDA with one rank, started in the background at the first constrained request (a request that may "
    "jump forward keeps its matcher in the step thread while fewer than 32 constrained requests are live; "
    "every constrained draw waits on the device for its masks), the step thread on CPU, with tensor "
    "parallelism or where the device cannot wait on host memory (not an x86 host); on: the process on any "
    "device, started with the engine; off: the step thread always (each draw held on the host until its "
    "masks are in)",
)
JUMP_FORWARD: EnvVar[bool] = EnvVar(
    "ASYNCLLM_JUMP_FORWARD",
    True,
    flag,
    "structured output's jump-forward: where a request's constraint forces the next text (a JSON schema's keys "
    "and punctuation), its tokens (the tokenizer's encoding of that text) are output without a draw each and "
    "computed in one step. Requests asking for logprobs, prompt logprobs or penalties never jump, nor do "
    "matchers in the grammar process, tensor-parallel engines, or the requests of a step that sampled more "
    "than 32 rows. false: every token is drawn (the token ids, not the text's rules, may then differ)",
)
GRAMMAR_PROCESS_THREADS: EnvVar[int | None] = EnvVar(
    "ASYNCLLM_GRAMMAR_PROCESS_THREADS",
    None,
    positive_or_auto,
    "the grammar process's threads, each accepting and filling a share of a step's rows. auto: the cores this "
    "process may use less two (the step thread and the device's driver), shared among tensor-parallel ranks, "
    "at most 8",
)
GRAMMAR_SLOW_FILL_MS: EnvVar[float | None] = EnvVar(
    "ASYNCLLM_GRAMMAR_SLOW_FILL_MS",
    1.0,
    ms_or_off,
    "structured output in the step thread: a request whose matcher costs more than this many milliseconds of "
    "CPU a token on average (accepting it and filling the next token mask: an enum, choice or regex of some "
    "20,000 alternatives takes 3-10 ms where an ordinary schema takes microseconds) moves to a thread of its "
    "own, and so do later requests with its constraint; while its next mask is not ready its draws sit out "
    "and the others' steps go on without it. One rank only. off: every mask is filled in the step",
)
CPU_INT4: EnvVar[CpuInt4] = EnvVar(
    "ASYNCLLM_CPU_INT4",
    CpuInt4.AUTO,
    one_of(CpuInt4),
    "on CPU, quantized linear layers (GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q5_K, AWQ, GPTQ) and a GGUF head stored with 8 bits "
    "or fewer run from torch's int4 kernel with bfloat16 inputs, weights kept packed: auto (where the CPU computes "
    "bfloat16 natively: AVX512-BF16 or AMX), off (GGUF files dequantized to float32 at load, as on other CPUs; "
    "the reference twin)",
)
CPU_DECODE: EnvVar[CpuDecode] = EnvVar(
    "ASYNCLLM_CPU_DECODE",
    CpuDecode.AUTO,
    one_of(CpuDecode),
    "on CPU, a Llama-family model's decode steps (every sequence one token, all of one length) run as one "
    "function of few ops over the same weights (paged attention through torch's scaled_dot_product_attention): "
    "auto (float32 models whose every layer it reproduces), off (the modules' forward; the twin)",
)
CPU_NATIVE: EnvVar[CpuNative] = EnvVar(
    "ASYNCLLM_CPU_NATIVE",
    CpuNative.AUTO,
    one_of(CpuNative),
    "on CPU, where that decode path's projections are all packed int4, each layer's small ops (add and RMSNorm, "
    "rotary and the cache write, attention, SiLU-and-multiply) run as four calls into C compiled on this machine "
    "the first time (cc, gcc, clang or $CC; kept under the cache directory), and on one thread a tied Q8_0 head "
    "reads the embedding's 8-bit codes there: auto (where a compiler builds it; else torch's ops, with a "
    "warning), off (torch's eager ops and the packed int4 head; the twin)",
)
# Read once per engine by the tensor-parallel executor, which sends every rank its choice.
TP_CUSTOM_ALL_REDUCE: EnvVar[bool] = EnvVar(
    "ASYNCLLM_TP_CUSTOM_ALL_REDUCE",
    True,
    flag,
    "on CUDA with tensor_parallel_size=2, all-reduces up to a decode step's hidden states ([max_num_seqs, "
    "hidden], bfloat16/float32) run a one-shot kernel over symmetric memory instead of NCCL; checked against "
    "NCCL at start-up, NCCL on any failure. false: NCCL only",
)
# The KV tiers below the device (`kv_offloading_size`, `kv_cache_dir`): read where each rank sets them up.
KV_OFFLOAD_AHEAD: EnvVar[int] = EnvVar(
    "ASYNCLLM_KV_OFFLOAD_AHEAD",
    256,
    count,
    "with a host tier, the free cached blocks (oldest freed first) each step copies to host memory beside its "
    "forward pass, so that a block the pool then takes for other content is there already; blocks the pool takes "
    "before that are copied before the forward pass that overwrites them (waiting). 0: only those",
)
KV_DISK_GIB: EnvVar[float | None] = EnvVar(
    "ASYNCLLM_KV_DISK_GIB",
    None,
    gib_or_auto,
    "the most GiB the disk tier (`kv_cache_dir`) keeps, shared by the tensor-parallel ranks, oldest blocks out "
    "first (other engines' files in the same directory counted). auto: half the space free on its file system "
    "when the engine starts, plus what the tier holds already",
)
KV_DISK_LOADS_PER_STEP: EnvVar[int] = EnvVar(
    "ASYNCLLM_KV_DISK_LOADS_PER_STEP",
    1024,  # an 8K-token history of blocks of 16 in one step: its reads all start at once
    positive,
    "blocks one step may start reading from the disk tier; the reads run on 2-8 threads (one a core) beside "
    "the steps while their requests wait, later steps start the rest, and the blocks read cross to the device "
    "while the rest are read (within the restore bound and the free blocks)",
)
KV_DISK_LOAD_THREADS: EnvVar[int | None] = EnvVar(
    "ASYNCLLM_KV_DISK_LOAD_THREADS",
    None,
    positive_or_auto,
    "threads that read the disk tier's files into host slots (auto: one a core, 2 to 8), in the reader process "
    "or the engine's (ASYNCLLM_KV_DISK_READER)",
)
KV_DISK_READER: EnvVar[KvDiskReader] = EnvVar(
    "ASYNCLLM_KV_DISK_READER",
    KvDiskReader.PROCESS,
    one_of(KvDiskReader),
    "where the disk tier's reads run: process (a process of their own over the host slots' shared memory, on "
    "Linux; elsewhere threads) or threads (of the engine's process, whose GIL they then share with the step "
    "thread: on an H100 machine a restart's reads ran at half their speed)",
)
KV_RESTORE_MIB_PER_STEP: EnvVar[int] = EnvVar(
    "ASYNCLLM_KV_RESTORE_MIB_PER_STEP",
    512,  # W10 on an H100: returning turns' TTFT p50 0.45 of the tier off unbounded, 0.33 at 1024, 0.32 at 512
    count,
    "with a host tier, the MiB of KV one step may restore from it (the device's side, all ranks alike); a "
    "request whose restore would pass it waits for the next step, unless it is the step's first. The next step's "
    "work waits for these copies, so a step that restores more than its own forward pass hides stalls every "
    "stream. 0: no bound",
)
TUNING_CACHE: EnvVar[bool] = EnvVar(
    "ASYNCLLM_TUNING_CACHE",
    True,
    flag,
    "keep the start-up GEMM timings' choices (per card, driver, library versions, kernel source and weight shape) "
    "in $XDG_CACHE_HOME/asyncllm/tuning (~/.cache/asyncllm/tuning), so a later start on the same card skips them. "
    "false: time at every start, keep nothing",
)

ALL: tuple[EnvVar[Any], ...] = (  # every variable, for docs/tuning.md's table and its test
    DEAD_ENGINE_JOIN_S,
    ASYNC_SCHEDULING,
    MAX_STEP_SECONDS,
    CPU_KVCACHE_SPACE,
    DECODE_GEMV,
    DECODE_PDL,
    DECODE_LAYER,
    DECODE_LAYER_PREFETCH,
    DECODE_FOLD_REDUCE,
    CASCADE_ATTENTION,
    CPU_INT4,
    CPU_DECODE,
    CPU_NATIVE,
    CUDA_GRAPH_SAMPLING,
    CUDA_GRAPH_MAX_TOKENS,
    CUDA_GRAPH_CAPTURE,
    GRAMMAR_PROCESS,
    GRAMMAR_PROCESS_THREADS,
    GRAMMAR_SLOW_FILL_MS,
    JUMP_FORWARD,
    TP_CUSTOM_ALL_REDUCE,
    KV_OFFLOAD_AHEAD,
    KV_DISK_GIB,
    KV_DISK_LOADS_PER_STEP,
    KV_DISK_LOAD_THREADS,
    KV_DISK_READER,
    KV_RESTORE_MIB_PER_STEP,
    TUNING_CACHE,
)

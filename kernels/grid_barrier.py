"""A grid-wide barrier for a persistent launch whose programs are all resident at once (at most one per SM), and
the clock stamps that time it. Device code only; on CUDA the wait spins on PTX's `ld.acquire` (the
interpreter, which has no PTX, on atomics: it runs one program, whose every arrival is the last).

The barrier's words (int32, zero at first): the round, then one arrival count for each barrier of a launch.
A launch reads the round once at its start (`barrier_round`): it cannot move before every program has arrived
at the launch's first barrier, so every program reads the same value. A barrier is an arrival
(`grid_arrive`) and a wait (`grid_wait`: until the round is that value + k), with room between them. Why
each barrier has its own count: the last to arrive advances the round first and clears the count after, so
nobody waits for the clearing (the next launch, after a kernel boundary, is its next user).
Critical path: the last arrival's atomic, one release, the spinners' next acquire read (a third of the L2 round
trips of a single reused count, whose clearing had to land before the release).
"""

from __future__ import annotations

import triton
import triton.language as tl

BARRIERS = 4  # barriers a launch passes at most
WORDS = 1 + BARRIERS  # the round, then the arrivals of barrier 1..BARRIERS
STAMPS = 2 + 2 * BARRIERS  # a program's clock readings: start, each barrier's arrival and return, end
STAMPS_C = tl.constexpr(STAMPS)  # the same, for device code


@triton.jit
def _load_acquire(ptr):
    """The int32 at ptr, read at GPU scope with acquire semantics (PTX: no atomic queues behind the arrivals)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def barrier_round(bar_ptr, ON: tl.constexpr):
    """The round at this launch's start (0 unless ON): read before the program's first arrival."""
    round0 = 0
    if ON:
        round0 = tl.load(bar_ptr, volatile=True)
    return round0


@triton.jit
def grid_arrive(bar_ptr, k, ON: tl.constexpr):
    """This program's arrival at barrier k (1..BARRIERS); nothing unless ON. The last to arrive advances the
    round. Split from `grid_wait` so that a program can ask for what its next phase reads between the two:
    the arrival's release fence waits for every load and store the program has in flight, so loads issued
    before it would hold the arrival back; issued after, they stream while the program waits.

    Why the data is visible after the wait: each program's threads finish their stores before its one arrival
    (the CTA barrier, then an acq_rel arrival at GPU scope, cumulative over them); the last arrival has
    acquired every earlier one (they form a release sequence on the count), and its release of the new round
    is cumulative over them; each waiting thread's acquire read of the new round orders its reads after all of
    it. The spin cannot starve: every program is resident."""
    if ON:
        tl.debug_barrier()
        if tl.atomic_add(bar_ptr + k, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
            tl.atomic_xchg(bar_ptr + k, 0, sem="relaxed", scope="gpu")  # cleared after: the next launch's


@triton.jit
def grid_wait(bar_ptr, k, round0, ON: tl.constexpr, PTX: tl.constexpr):
    """Returns once every program has arrived at barrier k of a launch that read `round0` at its start. PTX:
    spin on acquire loads; else on acquire atomics (the interpreter, which runs no PTX: one program there, whose
    arrival was the last, so one read)."""
    if ON:
        # The round cannot pass round0 + k before this program arrives at barrier k + 1: wait for equality,
        # wrapping (no overflow check, even in Triton's debug builds: the round counts launches forever).
        target = tl.add(round0, k, sanitize_overflow=False)
        if PTX:
            while _load_acquire(bar_ptr) != target:
                pass
        else:
            while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") != target:
                pass
        tl.debug_barrier()


@triton.jit
def stamp(clock_ptr, slot, TIMING: tl.constexpr):
    """TIMING: this program's reading of the GPU's nanosecond clock into its row of clock_ptr [programs, STAMPS]."""
    if TIMING:
        tl.store(clock_ptr + tl.program_id(0) * STAMPS_C + slot, tl.extra.cuda.globaltimer())


@triton.jit
def timed_arrive(bar_ptr, clock_ptr, k, ON: tl.constexpr, TIMING: tl.constexpr):
    """grid_arrive k, stamped (once every thread of the program is done) when TIMING."""
    if TIMING:
        tl.debug_barrier()
    stamp(clock_ptr, 2 * k - 1, TIMING)
    grid_arrive(bar_ptr, k, ON)


@triton.jit
def timed_wait(bar_ptr, clock_ptr, k, round0, ON: tl.constexpr, PTX: tl.constexpr, TIMING: tl.constexpr):
    """grid_wait k, its return stamped when TIMING."""
    grid_wait(bar_ptr, k, round0, ON, PTX)
    stamp(clock_ptr, 2 * k, TIMING)

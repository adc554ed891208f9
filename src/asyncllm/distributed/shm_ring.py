"""Broadcast of byte messages from one writer to N reader processes on one host, over a shared-memory ring.

This file owns the protocol both ends follow (below), the handle a reader attaches with, and the ring's errors;
`shm_writer` and `shm_reader` implement the two ends, `shm_segment` the memory and `shm_wakeup` the sleeping.
The ring carries opaque bytes: it knows nothing of what the engine sends, nor of torch or numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypeAlias

from asyncllm.errors import AsyncLLMError

BytesLike: TypeAlias = bytes | bytearray | memoryview

DEFAULT_SLOT_BYTES = 256 * 1024  # a decode step's inputs take a few KB; a long prefill's a few hundred
DEFAULT_N_SLOTS = 16
DEFAULT_SPIN_S = 50e-6  # a reader polls this long before it sleeps: fast hand-off, no core burnt while idle
DEFAULT_RECHECK_S = 0.05  # a sleeping reader re-checks this often: the most a lost wake-up can cost
DETACHED = 2**64 - 1  # a reader's pid field once it closed (0: not attached yet)

# The protocol. Chunks are numbered 1, 2, 3, ...: a message takes one chunk per slot it fills, and chunk s lives
# in slot s % n_slots. A slot's "written flag" is a stamp, the number of the chunk it holds; a reader's "read
# flag" for a slot is the number of the last chunk it read there. Stamps only grow, so the writer never has to
# clear a flag, and no reader can take the previous lap's chunk for the next one.
#
#   writer, chunk s:  wait until every read stamp of the slot >= s - n_slots (the previous lap was read)
#                     FENCE; payload and length; FENCE; written stamp := s; FENCE; wake readers flagged asleep
#   reader, chunk s:  wait until the written stamp == s; FENCE; copy the payload out; FENCE; read stamp := s;
#                     FENCE; wake the writer if it is flagged waiting
#
# Why no reader sees half a message: the written stamp is stored after a fence that follows the payload, and
# loaded before a fence that precedes the copy; the writer reuses the slot only after every reader's read stamp,
# each stored after a fence that follows that reader's copy. A stamp need not even be stored in one instruction
# (nothing in Python promises that of an 8-byte pack_into): a reader that sees exactly s has seen every byte that
# changed, all stored after the payload; a writer that sees a half-stored read stamp sees it only once that
# reader's copy is done, since the store began after its fence.
#
# FENCE: Python has no memory fence. Acquiring then releasing a threading.Lock runs sem_wait/sem_post or
# pthread_mutex_lock/unlock (in newer CPythons, an atomic compare-exchange on the lock), which POSIX requires to
# synchronize memory (XBD 4.12) and which are built on atomic read-modify-write instructions: a full barrier on
# x86 (LOCK prefix), and ordering on arm64 in the glibc and CPython builds we know; vLLM's shm_broadcast relies on
# the same. The compiler cannot move loads or stores across these opaque calls either. On x86-TSO the publication
# order above holds even without fences (stores become visible in program order, loads are not reordered with
# loads); there the fences matter for the sleeping handshake below (TSO lets a load pass an earlier store), and
# everywhere for weaker CPUs such as arm64 Grace hosts.
#
# Sleeping: a reader sets its sleeping flag, FENCEs, then re-checks the written stamp before it blocks; the
# writer stores the stamp, FENCEs, then reads the sleeping flags. Each side stores, fences, then loads what the
# other stores, so at least one sees the other (Dekker): the reader finds the chunk or the writer wakes it.
# A writer blocked on a full ring sleeps the same way, with its own flag and the roles swapped. Were a CPU to
# break that handshake, a sleeper still re-checks every `recheck_s`: a lost wake-up costs latency, never a message.
#
# Closing: the writer sets the closed flag after a fence that follows its last stamp, so a reader that sees the
# flag, fences and re-checks its next stamp never misses a message written before the close.


class RingClosedError(AsyncLLMError, EOFError):
    """No more messages will come: the writer closed the ring (after every earlier message was read), exited
    without closing it, or gave up mid-message; or this end was closed."""


class RingTimeoutError(AsyncLLMError, TimeoutError):
    """A read or write waited longer than its `timeout`; the message names what it waited for."""


class RingAttachError(AsyncLLMError, ValueError):
    """A reader cannot attach with this handle: a rank already attached, or a handle of another ring layout."""


class RingConfigError(AsyncLLMError, ValueError):
    """A bad ring argument (the message names it, its value and the fix), or a platform the ring cannot run on."""


class RingNoSpaceError(AsyncLLMError, OSError):
    """/dev/shm cannot hold the ring (errno ENOSPC); the message says how to make room."""


@dataclass(frozen=True)
class RingHandle:
    """What a reader process needs to attach (picklable, a few fields): pass it to the spawned worker."""

    name: str
    n_readers: int
    n_slots: int
    slot_bytes: int
    rank: int


def process_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    state = stat[stat.rindex(b")") + 2 :][:1]  # the field after "(command name)"
    return state not in (b"Z", b"X")


def describe_process(pid: int) -> str:
    if pid == 0:
        return "never attached"
    if pid == DETACHED:
        return "closed by its owner"
    return f"pid {pid}, {'alive' if process_alive(pid) else 'exited'}"

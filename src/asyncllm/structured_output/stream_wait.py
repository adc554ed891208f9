"""`StreamWaiter`: the device's stream made to wait for a word in host memory to reach a value (CUDA's stream
memory operations, through the driver API, as torch does not wrap them). The constrained draw is queued at
once behind such a wait, and the grammar process writes the word after the draw's bitmask rows: the step
thread never waits for the rows, and the device only where they are late. Knows nothing of grammars.
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)

_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0, so counters may wrap around


class StreamWaiter:
    """`wait(address, value)` on the current stream; `device_address(host)` for a word of registered memory."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._wait = lib.cuStreamWaitValue32_v2
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._pointer = lib.cuMemHostGetDevicePointer_v2
        self._pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._pointer.restype = ctypes.c_int

    @classmethod
    def open(cls, probe_host_address: int) -> StreamWaiter | None:
        """The driver's stream waits, checked on a word of registered host memory that holds 0 (a wait for 0
        that passes at once), or None where the driver lacks them or refuses that memory."""
        try:
            waiter = cls(ctypes.CDLL("libcuda.so.1"))
            waiter.wait(waiter.device_address(probe_host_address), 0)
            torch.cuda.current_stream().synchronize()
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.info("stream waits on host memory unavailable (%s): constrained draws wait on the host", exc)
            return None
        return waiter

    def device_address(self, host_address: int) -> int:
        """The device's address of a word of host memory registered with CUDA."""
        out = ctypes.c_uint64(0)
        error = self._pointer(ctypes.byref(out), ctypes.c_void_p(host_address), 0)
        if error:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {error})")
        return out.value

    def wait(self, device_address: int, value: int) -> None:
        """Queue on the current stream: nothing after this runs until the word reaches `value` (mod 2**32)."""
        stream = torch.cuda.current_stream().cuda_stream
        error = self._wait(ctypes.c_void_p(stream), device_address, value & 0xFFFFFFFF, _GEQ)
        if error:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {error})")

"""Host memory allocator settings for training processes.

A training step allocates and frees the same large tensors every step (logits, activations,
gradients: tens of MB each at 64 x 8 toy rollouts). glibc's malloc serves blocks above its
mmap threshold (at most 32 MB by default) with fresh `mmap`s and returns freed heap tops to the
OS beyond its trim threshold, so every step page-faults its memory in again. Keeping freed
memory in the process (as jemalloc / tcmalloc do) removes that cost without changing any
number the step computes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = {_M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 64 << 20, _M_MMAP_THRESHOLD: 1 << 30}
DISABLE_ENV = "OMGRPO_MALLOC_TUNING"  # "0": leave the allocator as it is


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (blocks up to 1 GiB come from the heap, which
    is trimmed only beyond 1 GiB free). Returns whether the settings were applied: False on
    other platforms or C libraries, or with OMGRPO_MALLOC_TUNING=0."""
    if os.environ.get(DISABLE_ENV) == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS.items())

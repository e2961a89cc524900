"""The host heap's free pages handed back to the OS.

glibc's allocator keeps the pages of freed heap chunks that lie below a live one; a process that
frees a burst of tensors and then allocates others, of other sizes, holds both in its resident
memory. ``malloc_trim(0)`` returns every free page of every arena."""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def release_freed_host_memory() -> None:
    """Hand the pages of the host heap's free chunks back to the OS (nothing without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)

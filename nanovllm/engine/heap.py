"""Give freed heap memory back to the operating system after a load.

Loading a model allocates far more than it keeps: the float parameters the model is built with
before packed weights replace them, a tensor's bytes on their way from the file, a tokenizer
converted and dropped. glibc keeps what is freed in its arenas for reuse, so the process's
resident memory stays at the load's peak (on the default GGUF model on CPU, ~180 MB above what
the engine holds) until `malloc_trim` returns the free pages. Called once after each load; a
no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (every arena); True where it could run."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

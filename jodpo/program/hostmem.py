"""Give the compiler's freed scratch memory back to the operating system after every XLA compilation.

Compiling a large step, XLA allocates hundreds of MiB of small objects and frees them at the end; glibc keeps
those pages in its heap, and the step's own buffers (large blocks, mapped elsewhere) cannot reuse them, so
the process's resident memory stays that much higher for the rest of the run. A JAX monitoring listener calls
glibc's ``malloc_trim(0)`` when a backend compilation finishes, before the compiled step first runs.
Measured on the benchmark's online DPO step (docs/performance.md): 2513 -> 1986 MiB of RSS after compiling the step.

Every command installs it once (``backend.start_command``); it does nothing where the C library has no
``malloc_trim`` (macOS, musl).
"""
from __future__ import annotations

import ctypes
import ctypes.util

from jax import monitoring

# jax._src.dispatch.BACKEND_COMPILE_EVENT: recorded when XLA has compiled a computation, before it runs.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _load_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()
_installed = False


def release() -> bool:
    """Return the free pages of the C heap to the operating system now; whether anything was released."""
    return bool(_malloc_trim(0)) if _malloc_trim is not None else False


def _on_event(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        release()


def install() -> bool:
    """Release the C heap's free pages after every XLA compilation (once per process); whether it is active."""
    global _installed
    if _malloc_trim is None:
        return False
    if not _installed:
        monitoring.register_event_duration_secs_listener(_on_event)
        _installed = True
    return True

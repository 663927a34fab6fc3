"""The C heap is trimmed after each XLA compilation (see jodpo/hostmem.py), and only then."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo  # noqa: F401  (installs the listener)
from jodpo.program import hostmem


def test_every_compilation_and_nothing_else_trims_the_heap(monkeypatch):
    if hostmem._malloc_trim is None:
        pytest.skip("this C library has no malloc_trim")
    calls = []
    monkeypatch.setattr(hostmem, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    assert hostmem.install() and hostmem.install()  # idempotent: one listener, however often installed
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + x.sum())
    f(np.ones((7, 3), np.float32)).block_until_ready()
    assert calls == [0]
    f(np.zeros((7, 3), np.float32)).block_until_ready()  # cached: no compilation, no trim
    assert calls == [0]
    f(np.ones((5, 2), np.float32)).block_until_ready()  # a new shape compiles again
    assert calls == [0, 0]

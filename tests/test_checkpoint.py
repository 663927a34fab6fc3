"""The checkpoint's non-finite check: every leaf, dtype and position, and no memory beyond the state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodpo.checkpoint import all_finite


def _tree(dtype=jnp.float32):
    return {"w": jnp.ones((3, 5), dtype), "b": jnp.zeros((0,), dtype), "step": jnp.int32(7),
            "m": {"mu": jnp.full((4,), -2.0, jnp.bfloat16), "nu": jnp.arange(6.0, dtype=dtype)}}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["first", "last"])
def test_any_non_finite_entry_in_any_leaf_is_found(dtype, bad, where):
    tree = _tree(dtype)
    assert bool(all_finite(tree))
    for path in (("w",), ("m", "mu"), ("m", "nu")):
        t = jax.tree.map(lambda x: x, tree)
        leaf = t[path[0]] if len(path) == 1 else t[path[0]][path[1]]
        leaf = leaf.reshape(-1).at[0 if where == "first" else -1].set(bad).reshape(leaf.shape)
        if len(path) == 1:
            t[path[0]] = leaf
        else:
            t[path[0]][path[1]] = leaf
        assert not bool(all_finite(t)), (path, bad, where)


def test_large_finite_values_and_integer_leaves_pass():
    big = jnp.finfo(jnp.float32).max
    assert bool(all_finite({"a": jnp.full((8,), big), "b": jnp.full((8,), -big), "i": jnp.int32(2**31 - 1)}))
    assert bool(all_finite({"i": jnp.arange(3)}))  # nothing to check


def test_the_check_needs_no_memory_beyond_the_state():
    """A boolean mask of every entry (what ``all(isfinite(x))`` compiled to on the CPU) would be a quarter of
    the state's bytes at each save; the reduction keeps the temporaries to a few bytes per leaf."""
    tree = [jax.ShapeDtypeStruct((1 << 20,), jnp.float32) for _ in range(8)]
    mem = all_finite.lower(tree).compile().memory_analysis()
    if mem is None:
        pytest.skip("this backend reports no memory analysis")
    assert mem.temp_size_in_bytes < 64 * 1024, mem

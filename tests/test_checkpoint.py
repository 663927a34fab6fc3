"""The checkpoint's non-finite check: every leaf, dtype, length and position, and no mask of the whole state;
save_total_limit's rotation: what is on disk while a checkpoint is written."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodpo.checkpoint import Checkpointer, all_finite


def _tree(dtype, n):
    return {"w": jnp.ones((3, n), dtype), "b": jnp.zeros((0,), dtype), "step": jnp.int32(7),
            "m": {"mu": jnp.full((n,), -2.0, jnp.bfloat16), "nu": jnp.arange(n, dtype=jnp.float32) / n}}


# Long leaves too: XLA:CPU reduces them in vectorised blocks, where a max reduction was seen to drop NaNs.
@pytest.mark.parametrize("n", [5, 100_003])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_any_non_finite_entry_in_any_leaf_is_found(n, dtype, bad):
    tree = _tree(dtype, n)
    assert bool(all_finite(tree))
    for key in ("w", "mu", "nu"):
        for pos in (0, 1, n // 2, -1):
            t = {"w": tree["w"], "b": tree["b"], "step": tree["step"], "m": dict(tree["m"])}
            parent = t if key == "w" else t["m"]
            leaf = parent[key]
            parent[key] = leaf.reshape(-1).at[pos].set(bad).reshape(leaf.shape)
            assert not bool(all_finite(t)), (key, pos, bad)


def test_large_finite_values_and_integer_leaves_pass():
    big = jnp.finfo(jnp.float32).max
    assert bool(all_finite({"a": jnp.full((100_003,), big), "b": jnp.full((8,), -big), "i": jnp.int32(2**31 - 1)}))
    assert bool(all_finite({"i": jnp.arange(3)}))  # nothing to check


def test_the_check_holds_no_mask_of_the_state():
    """A boolean mask of every entry (what ``all(isfinite(x))`` compiled to on the CPU) is a quarter of the
    state's bytes at each save; the check's temporaries stay within one leaf."""
    leaf = jax.ShapeDtypeStruct((1 << 20,), jnp.float32)
    mem = all_finite.lower([leaf] * 8).compile().memory_analysis()
    if mem is None:
        pytest.skip("this backend reports no memory analysis")
    assert mem.temp_size_in_bytes <= 4 * (1 << 20) + 64 * 1024, mem


def _on_disk(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("limit, while_writing, kept", [
    (2, [[], [1], [2], [3]], [3, 4]),  # the oldest goes just before the write: never more than 2 on disk
    (3, [[], [1], [1, 2], [2, 3]], [2, 3, 4]),
    (1, [[], [1], [2], [3]], [4]),  # the only checkpoint stays until the next one is complete
    (None, [[], [1], [1, 2], [1, 2, 3]], [1, 2, 3, 4]),
])
def test_save_total_limit_keeps_the_newest_and_a_complete_one_while_writing(tmp_path, limit, while_writing, kept):
    ckpt = Checkpointer(tmp_path, limit)
    seen, save = [], ckpt.manager.save

    def watched(step, *args, **kwargs):  # what is on disk, complete, when the write of ``step`` begins
        ckpt.manager.wait_until_finished()  # as Orbax's save does first
        seen.append(_on_disk(tmp_path))
        return save(step, *args, **kwargs)

    ckpt.manager.save = watched
    for step in range(1, 5):
        ckpt.save(step, {"w": jnp.full((3,), step, jnp.float32)}, {"step": step})
    ckpt.close()
    assert seen == while_writing and _on_disk(tmp_path) == ckpt.steps() == kept
    restored = Checkpointer(tmp_path).restore_latest({"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert restored[0] == 4 and np.array_equal(restored[1]["w"], np.full((3,), 4.0))

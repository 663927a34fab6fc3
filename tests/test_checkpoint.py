"""The checkpoint's non-finite check: every leaf, dtype, length and position, and no mask of the whole state;
save_total_limit's rotation: what is on disk while a checkpoint is written; checksums: a changed bit is found at
restore (the previous checkpoint is used), a clean checkpoint restores bitwise, an older one without them restores."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jodpo.errors import CheckpointError
from jodpo.program.checkpoint import Checkpointer, all_finite, checksums, restore_params


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


# Checksums: a bit changed on disk is found at restore and the previous checkpoint used; a clean one restores as saved.

def _state(step: int) -> dict:
    """A state of every kind of leaf a TrainState holds; ``w`` is large enough (16 KiB) that OCDBT stores its bytes
    raw in a data file, not inside a compressed B-tree node (whose own checksum would catch a flip)."""
    return {"params": {"w": jnp.full((64, 64), 1.25 + step, jnp.float32), "e": jnp.arange(6, dtype=jnp.bfloat16)},
            "opt_state": {"mu": jnp.linspace(-1, 1, 10, dtype=jnp.float32), "count": jnp.int32(step)},
            "rng": jax.random.PRNGKey(step)}


def _abstract():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))


def _saved(directory, steps=(1, 2)) -> Checkpointer:
    ckpt = Checkpointer(directory)
    for step in steps:
        ckpt.save(step, _state(step), {"step": step, "dataset_rows": 16})
    ckpt.close()
    return ckpt


def _flip_one_bit_of_w(step_dir) -> None:
    pattern = np.full(8, 1.25 + int(step_dir.name), np.float32).tobytes()
    files = [p for p in step_dir.rglob("*") if p.is_file() and pattern in p.read_bytes()]
    assert len(files) == 1, files  # the array's bytes, as written
    data = bytearray(files[0].read_bytes())
    data[data.find(pattern) + 4 * 1000 + 2] ^= 0x20  # one bit of one entry, in the middle of the array
    files[0].write_bytes(bytes(data))


def _assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_a_clean_checkpoint_restores_bitwise_with_its_meta_as_saved(tmp_path, caplog):
    _saved(tmp_path)
    with caplog.at_level("INFO", logger="jodpo"):
        step, state, meta = Checkpointer(tmp_path).restore_latest(_abstract())
    assert step == 2 and meta == {"step": 2, "dataset_rows": 16} and not caplog.records
    _assert_same(state, _state(2))
    _assert_same(restore_params(tmp_path / "2"), _state(2)["params"])


def test_a_flipped_bit_is_found_at_restore_and_the_previous_checkpoint_used(tmp_path, caplog):
    _saved(tmp_path)
    _flip_one_bit_of_w(tmp_path / "2")
    damaged = {p.relative_to(tmp_path / "2"): p.read_bytes() for p in (tmp_path / "2").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / '2'} is damaged: its array params/w reads back other "
                                              "than it was written"):
        restore_params(tmp_path / "2")  # what export_hf and generate read: they try the previous step
    step, state, meta = Checkpointer(tmp_path).restore_latest(_abstract())
    assert step == 1 and meta["step"] == 1
    _assert_same(state, _state(1))
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert re.fullmatch(rf"checkpoint {tmp_path}/2 is damaged: its array params/w reads back other than it was "
                        rf"written \(checksum [0-9a-f]{{16}} saved, [0-9a-f]{{16}} read\); it is moved aside to "
                        rf"{tmp_path}/2\.damaged, trying the previous one", line), line
    # kept for inspection as it was, never deleted; the run saves step 2 again when it gets there
    assert {p.relative_to(tmp_path / "2.damaged"): p.read_bytes()
            for p in (tmp_path / "2.damaged").rglob("*") if p.is_file()} == damaged
    assert Checkpointer(tmp_path).steps() == [1]


def test_a_changed_meta_is_found_and_with_no_checkpoint_left_the_run_starts_fresh(tmp_path, caplog):
    _saved(tmp_path, steps=(1,))
    f = tmp_path / "1" / "meta" / "metadata"
    f.write_text(f.read_text().replace('"dataset_rows": 16', '"dataset_rows": 17'))
    assert Checkpointer(tmp_path).restore_latest(_abstract()) is None  # as when no checkpoint reads back
    assert "checkpoint {}/1 is damaged: its meta (the data position".format(tmp_path) in caplog.text
    assert (tmp_path / "1.damaged").is_dir() and not (tmp_path / "1").exists()


def test_a_checkpoint_saved_before_checksums_restores_unchecked(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    ckpt.manager.save(3, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(3)),
                                                 meta=ocp.args.JsonSave({"step": 3})))
    ckpt.close()
    with caplog.at_level("INFO", logger="jodpo"):
        step, state, meta = Checkpointer(tmp_path).restore_latest(_abstract())
    assert step == 3 and meta == {"step": 3}
    _assert_same(state, _state(3))
    assert f"checkpoint {tmp_path}/3 has no checksums (saved before jodpo kept them): restored unchecked" in caplog.text
    _assert_same(restore_params(tmp_path / "3"), _state(3)["params"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint32, jnp.bool_])
def test_any_changed_bit_changes_the_checksum_of_its_leaf_only(dtype):
    """Each bit of each entry in turn, and the pairs a plain sum misses (two top bits, two swapped entries)."""
    x = (jnp.arange(24).reshape(2, 3, 4) % 2 if dtype == jnp.bool_ else jnp.arange(24).reshape(2, 3, 4)).astype(dtype)
    other = jnp.ones((5,), jnp.float32)
    base = checksums([x, other])
    host = np.asarray(x).reshape(-1)
    words = host.view(np.uint8)
    for byte in range(words.size):
        for bit in range(1 if dtype == jnp.bool_ else 8):  # a bool is one bit
            flipped = words.copy()
            flipped[byte] ^= 1 << bit
            got = checksums([jnp.asarray(flipped.view(host.dtype).reshape(x.shape)), other])
            # both 32-bit halves change, and only this leaf's
            assert got[0][:8] != base[0][:8] and got[0][8:] != base[0][8:] and got[1] == base[1], (byte, bit)
    if dtype == jnp.float32:
        two_signs = x.at[0, 0, 1].set(-1.0).at[0, 0, 2].set(-2.0)  # two top bits: a sum mod 2**32 is unchanged
        swapped = x.reshape(-1)[jnp.array([1, 0] + list(range(2, 24)))].reshape(x.shape)
        for changed in (two_signs, swapped):
            assert checksums([changed, other])[0] != base[0]


def test_save_only_model_keeps_the_parameters_and_a_resume_gets_a_new_optimizer(tmp_path):
    """transformers' ``save_only_model``: no optimizer state on disk; the checkpoint fits the configured model (its
    arrays are checked without the optimizer's) and restores with ``opt_state`` None, for ``optim.restarted``."""
    from jodpo.optim import OptimizerConfig, make_optimizer, restarted

    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, _state(2), {"step": 2, "dataset_rows": 16}, only_model=True)
    ckpt.close()
    ckpt = Checkpointer(tmp_path)
    assert not ckpt.has_optimizer(2) and ckpt.misfit(2, _abstract()) == []
    step, state, _ = ckpt.restore_latest(_abstract())
    assert step == 2 and state["opt_state"] is None
    _assert_same(state["params"], _state(2)["params"])
    # the new optimizer: AdamW from its first step (moments 0, bias correction from 1), the schedule where the run is
    cfg = OptimizerConfig(learning_rate=1e-3, total_steps=10, warmup_steps=4)
    fresh = restarted(cfg, state["params"], 7)
    _, (adam, _, schedule) = fresh
    assert int(adam.count) == 0 and int(schedule.count) == 7
    assert all(not np.asarray(x).any() for x in jax.tree.leaves((adam.mu, adam.nu)))
    assert jax.tree.structure(fresh) == jax.tree.structure(make_optimizer(cfg).init(state["params"]))

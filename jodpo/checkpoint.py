"""Orbax checkpoints of the training state (params, optimizer state, step, rng) and the data position.

``output_dir/checkpoints/<step>/`` is written by an Orbax ``CheckpointManager``: each save goes to a
temporary directory that is renamed when complete, so a crash during a save leaves the previous checkpoint
usable. Restoring takes an *abstract* state (``jax.eval_shape``) whose shardings say where every array goes,
so a checkpoint written on one mesh restores on another.
"""
from __future__ import annotations

import contextlib
import errno
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jodpo.models import CheckpointError

log = logging.getLogger("jodpo")


class SaveError(RuntimeError):
    """A checkpoint that was not written (disk full, a non-finite state); the previous ones are intact."""


def _disk_full(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@jax.jit
def all_finite(tree) -> jax.Array:
    """True when every floating-point entry of ``tree`` is finite.

    Each leaf is reduced as ``sum(x * 0)``: 0 when every entry is finite, NaN when one is a NaN or an infinity
    (IEEE additions always propagate a NaN; a ``max`` reduction does not on XLA:CPU, whose vectorised maximum
    drops NaNs in long arrays). ``all(isfinite(x))`` compiled on the CPU to a boolean mask of every entry, a
    quarter of the state's bytes at each save; this needs at most one leaf's worth of temporaries."""
    finite = [jnp.isfinite(jnp.sum(x * 0, dtype=jnp.float32)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)


class Checkpointer:
    """``save_total_limit`` keeps the newest checkpoints. With a limit of 2 or more, the oldest one over it is
    deleted just before a save, once the previous saves are complete (Orbax's ``max_to_keep`` deletes after the
    save): the disk never holds more than the limit, ``limit - 1`` complete checkpoints remain while one is
    written, and the write fills the page cache the deleted files just gave back. Freshly allocated memory can
    cost far more than the write itself: on a VM whose free memory is reported to its host (virtio-balloon free
    page reporting), a 806 MiB save took 2.6-3.2 kernel CPU-seconds deleting after and 0.3-0.4 deleting before.
    A limit of 1 deletes after the save, so that a complete checkpoint always exists."""

    def __init__(self, directory: str | Path, save_total_limit: int | None = None):
        self.directory = Path(directory).absolute()
        self.rotate_before = save_total_limit if save_total_limit is not None and save_total_limit >= 2 else None
        # Uncompressed: float32 weights and Adam moments are noise to zstd (8% smaller on disk), and compressing
        # them was most of a save's CPU time (2-4 CPU-seconds per 800 MB against 0.5), taken from the training
        # loop's cores while the save writes in the background. Compressed checkpoints still read.
        keep = None if self.rotate_before else save_total_limit
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(use_compression=False),
                           "meta": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state, meta: dict) -> None:
        """Write ``state`` (a pytree of arrays) and ``meta`` (JSON: the data position, the config) as ``step``.

        A state with a non-finite entry is never written (it would become the one a resume starts from), and
        a full disk is reported as such; in both cases the previous checkpoints stay as they were."""
        if not bool(jax.device_get(all_finite(state))):
            raise SaveError(f"the training state at step {step} has non-finite values (NaN or Inf); it was not saved, "
                            f"so {self.directory} still ends with the last finite checkpoint. Lower the "
                            "learning rate or check the rewards, then resume")
        if self.rotate_before:
            self.wait()  # the newest must be complete before the oldest goes (a save waits for it anyway)
            older = [s for s in self.steps() if s != step]
            for old in older[:max(0, len(older) - (self.rotate_before - 1))]:
                self.manager.delete(old)
        with self._disk_errors(step):
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until the (asynchronous) saves so far are on disk."""
        with self._disk_errors(self.manager.latest_step()):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _disk_errors(self, step):
        try:
            yield
        except Exception as e:
            if _disk_full(e):
                raise SaveError(f"no space left on device while saving checkpoint {step} to {self.directory}; the "
                                "previous checkpoints are intact (a save is written aside and renamed when "
                                "complete). Free space (or set save_total_limit), then run the same command to "
                                "resume") from e
            raise

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def misfit(self, step: int, abstract_state) -> list[str]:
        """How checkpoint ``step``'s arrays differ from ``abstract_state``'s (paths missing on either side, other
        shapes), read from its metadata alone; [] when they fit, or when the metadata cannot be read (a damaged
        checkpoint is for ``restore_latest`` to find)."""
        try:
            saved = _shapes(self.manager.item_metadata(step)["state"])
        except Exception:  # noqa: BLE001 - unreadable metadata: damaged, not misfit
            return []
        wanted = _shapes(abstract_state)
        out = [(k, f"{k}: {saved[k]} in the checkpoint, {wanted[k]} configured") for k in wanted
               if k in saved and saved[k] != wanted[k]]
        out += [(k, f"{k}: configured, not in the checkpoint") for k in wanted if k not in saved]
        out += [(k, f"{k}: in the checkpoint, not configured") for k in saved if k not in wanted]
        return [line for k, line in sorted(out, key=lambda x: not x[0].startswith("params/"))]  # the model's first

    def restore_latest(self, abstract_state):
        """``(step, state, meta)`` of the newest checkpoint that reads back, or None if there is none.

        A checkpoint that fails to read (partial or corrupt) is skipped for the previous one, with a warning,
        and moved aside to ``<step>.unreadable`` (kept for inspection, not deleted), so that the run can save
        that step again when it gets there."""
        skipped = []
        for step in reversed(self.steps()):
            try:
                state = ocp.args.PyTreeRestore(abstract_state, ocp.checkpoint_utils.construct_restore_args(
                    abstract_state))
                out = self.manager.restore(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
                break
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
                log.warning("checkpoint %s/%d is unreadable (%s: %s); trying the previous one", self.directory, step,
                            type(e).__name__, e)
                skipped.append(step)
        else:
            out = None
        if skipped:
            if jax.process_index() == 0:
                for s in skipped:
                    aside = self.directory / f"{s}.unreadable"
                    while aside.exists():
                        aside = aside.with_name(aside.name + "~")
                    (self.directory / str(s)).rename(aside)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("jodpo: unreadable checkpoints moved aside")
            self.manager.reload()
        return None if out is None else (step, out.state, out.meta)

    def close(self) -> None:
        self.wait()
        self.manager.close()


def _shapes(tree) -> dict[str, tuple]:
    """{"params/layers/attn/q": shape} of a state, its ShapeDtypeStructs or Orbax's metadata of it alike (a
    dataclass's fields, a named tuple's names and dict keys all read as names; None subtrees hold nothing)."""
    tree = getattr(tree, "tree", tree)  # Orbax's tree metadata wraps the tree
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in flat}


def find_step_dir(path: str | Path) -> list[Path]:
    """Step directories to try for ``path``: one step (``.../checkpoints/<step>``) or, for an output directory
    (or its ``checkpoints/``), all its finished steps, newest first."""
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; give a training output_dir or one of its "
                                "checkpoints/<step> directories")
    if (path / "state").is_dir():
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(p.name), p) for p in root.iterdir() if p.name.isdigit() and (p / "state").is_dir())
    if not steps:
        raise FileNotFoundError(f"{path} holds no checkpoint (no checkpoints/<step>/state); train first, or give "
                                "the output_dir of a run that saved one")
    return [p for _, p in reversed(steps)]


def restore_params(step_dir: str | Path, device=None):
    """The policy parameters of one checkpoint step, on one device (the CPU by default), whatever mesh wrote
    them: only ``state/params`` is read."""
    path = Path(step_dir).absolute()
    dev = jax.sharding.SingleDeviceSharding(device or jax.devices("cpu")[0])
    # The step as the CheckpointManager wrote it (state and meta), read whole: the step's own metadata file is
    # found where it is (reading state/ alone logs "Metadata file does not exist" for state/ at every export)
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(state=ocp.PyTreeCheckpointHandler(),
                                                            meta=ocp.JsonCheckpointHandler()))
    try:
        meta = ckptr.metadata(path).item_metadata["state"]["params"]
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), meta)}
        args = ocp.args.PyTreeRestore(item=item, restore_args=jax.tree.map(
            lambda _: ocp.ArrayRestoreArgs(sharding=dev), item), partial_restore=True)
        return ckptr.restore(path, args=ocp.args.Composite(state=args))["state"]["params"]
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; the caller needs one
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from e


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

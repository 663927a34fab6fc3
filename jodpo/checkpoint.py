"""Orbax checkpoints of the training state (params, optimizer state, step, rng) and the data position.

``output_dir/checkpoints/<step>/`` is written by an Orbax ``CheckpointManager``: each save goes to a
temporary directory that is renamed when complete, so a crash during a save leaves the previous checkpoint
usable. Restoring takes an *abstract* state (``jax.eval_shape``) whose shardings say where every array goes,
so a checkpoint written on one mesh restores on another.
"""
from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jodpo.models import CheckpointError

log = logging.getLogger("jodpo")


class Checkpointer:
    def __init__(self, directory: str | Path, save_total_limit: int | None = None):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=save_total_limit, create=True))

    def save(self, step: int, state, meta: dict) -> None:
        """Write ``state`` (a pytree of arrays) and ``meta`` (JSON: the data position, the config) as ``step``."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state):
        """``(step, state, meta)`` of the newest checkpoint that reads back, or None if there is none.

        A checkpoint that fails to read (partial or corrupt) is skipped for the previous one, with a warning."""
        for step in reversed(self.steps()):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                return step, out.state, out.meta
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
                log.warning("checkpoint %s/%d is unreadable (%s: %s); trying the previous one", self.directory, step,
                            type(e).__name__, e)
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


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
    path = Path(step_dir).absolute() / "state"
    dev = jax.sharding.SingleDeviceSharding(device or jax.devices("cpu")[0])
    ckptr = ocp.PyTreeCheckpointer()
    try:
        meta = ckptr.metadata(path).item_metadata["params"]
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), meta)}
        args = ocp.args.PyTreeRestore(item=item, restore_args=jax.tree.map(
            lambda _: ocp.ArrayRestoreArgs(sharding=dev), item), partial_restore=True)
        return ckptr.restore(path, args=args)["params"]
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; the caller needs one
        raise CheckpointError(f"{path.parent} is not a readable checkpoint ({type(e).__name__}: {e})") from e


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

"""Orbax checkpoints of the training state (params, optimizer state, step, rng) and the data position.

``output_dir/checkpoints/<step>/`` is written by an Orbax ``CheckpointManager``: each save goes to a
temporary directory that is renamed when complete, so a crash during a save leaves the previous checkpoint
usable. Restoring takes an *abstract* state (``jax.eval_shape``) whose shardings say where every array goes,
so a checkpoint written on one mesh restores on another.

Each checkpoint's ``meta`` holds a checksum of every array of the state as it was saved, and one of ``meta``
itself; a restore compares them with what it read, so a bit changed on disk (or in a copy) is found there, not ten
NaN steps later (Orbax checks none: OCDBT's checksums cover its B-tree nodes, not the array bytes).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jodpo import collective_order
from jodpo.errors import CheckpointError, SaveError

log = logging.getLogger("jodpo")



def _disk_full(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@collective_order.jit
def all_finite(tree) -> jax.Array:
    """True when every floating-point entry of ``tree`` is finite.

    Each leaf is reduced as ``sum(x * 0)``: 0 when every entry is finite, NaN when one is a NaN or an infinity
    (IEEE additions always propagate a NaN; a ``max`` reduction does not on XLA:CPU, whose vectorised maximum
    drops NaNs in long arrays). ``all(isfinite(x))`` compiled on the CPU to a boolean mask of every entry, a
    quarter of the state's bytes at each save; this needs at most one leaf's worth of temporaries."""
    finite = [jnp.isfinite(jnp.sum(x * 0, dtype=jnp.float32)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)


def _words(x) -> jax.Array:
    """The bits of ``x`` as uint32 words: one an entry (8- and 16-bit types widened), two for 64-bit types."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    u = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(u, jnp.uint32) if u.dtype.itemsize == 8 else u.astype(jnp.uint32)


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that spreads each input bit over the whole word."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@collective_order.jit
def _leaf_checksum(x) -> jax.Array:
    """Two 32-bit sums (modulo 2**32) of every word mixed with its position: u32[2]. Each word goes through a
    bijection of its own, so a change to any one word always changes both sums, and other damage (several
    words, swapped blocks) is missed with odds of about 2**-64. The position is the flat index built from
    iotas (no reshape, so a sharded array is never gathered), and the sums do not depend on the order they are
    added in: the same array gives the same checksum on every mesh, in every layout."""
    u = _words(x)
    idx, stride = jnp.uint32(0), 1
    for d in reversed(range(u.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(stride % 2**32)
        stride *= u.shape[d]
    a = _fmix(u ^ (idx * jnp.uint32(0x9E3779B9)))
    b = _fmix((u * jnp.uint32(0x27D4EB2F) + idx) ^ jnp.uint32(0x165667B1))
    # One reduction of both (XLA:CPU took 10x longer for two jnp.sum of uint32 than for this)
    sums = jax.lax.reduce((a, b), (jnp.uint32(0), jnp.uint32(0)), lambda p, q: (p[0] + q[0], p[1] + q[1]),
                          tuple(range(u.ndim)))
    return jnp.stack(sums)


def checksums(tree) -> list[str]:
    """Each leaf's checksum (16 hex digits), computed where the arrays are: on the accelerator, one pass over the
    state's memory and no copy to the host (hashing the bytes on the host would copy the whole state there, and
    each host of a multi-host run holds only its shards). One small program per leaf shape and dtype, reused
    across leaves: on a CPU each compiles in about 0.1 s, where one program over 120 leaves took 4-5 s.

    Cost at a save, measured on 2 shared CPU cores for a 675 MiB state (25M float32 parameters and AdamW's two
    moments, 110 leaves): 125 ms (the non-finite check: 145 ms), so the save's blocking part went from
    265-271 ms to 372-398 ms; the background write (2.1-2.6 s) varied more than that. On an accelerator it is
    one read of the state at memory bandwidth."""
    leaves = jax.tree.leaves(tree)
    jax.block_until_ready(leaves)
    # One program at a time, each waited for: a sharded leaf's checksum is a multi-device program with collectives,
    # and XLA:CPU deadlocked (a cross-device all-gather waiting forever, on 2 cores with 8 fake devices) when
    # several of them were in flight at once.
    sums = [jax.device_get(_leaf_checksum(x)) for x in leaves]
    return [f"{int(a):08x}{int(b):08x}" for a, b in sums]


def _meta_checksum(meta: dict) -> str:
    return f"{zlib.crc32(json.dumps(meta, sort_keys=True).encode()):08x}"


def damage(tree, meta: dict) -> str | None:
    """What in a restored checkpoint (``tree`` restored with its ``meta``) differs from the checksums saved with
    it: a line naming the array (or the meta), None when all match. ``tree`` may be a part of the saved state
    (``{"params": ...}``): only its arrays are checked. A checkpoint saved without checksums is not checked."""
    saved = meta.get("checksums")
    if saved is None:
        return None
    if not (isinstance(saved, dict) and isinstance(saved.get("arrays"), dict)):
        return f"its checksums are not what jodpo writes ({str(saved)[:80]})"
    rest = {k: v for k, v in meta.items() if k != "checksums"}
    if saved.get("meta") != _meta_checksum(rest):
        return (f"its meta (the data position, the dataset's fingerprint) reads back other than it was written "
                f"(crc32 {saved.get('meta')} saved, {_meta_checksum(rest)} read)")
    names = _paths(tree)
    for name, got in zip(names, checksums(tree)):
        if saved["arrays"].get(name, got) != got:
            return (f"its array {name} reads back other than it was written (checksum {saved['arrays'][name]} "
                    f"saved, {got} read)")
    return None


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

    def save(self, step: int, state, meta: dict, only_model: bool = False) -> None:
        """Write ``state`` (a pytree of arrays) and ``meta`` (JSON: the data position, the config) as ``step``;
        ``only_model`` (``save_only_model``): without the optimizer state (a third of a float32 state's bytes).

        A state with a non-finite entry is never written (it would become the one a resume starts from), and
        a full disk is reported as such; in both cases the previous checkpoints stay as they were."""
        if only_model:
            state = without_optimizer(state)
        finite = bool(jax.device_get(all_finite(state)))
        sums = checksums(state)  # after it, never beside it (``checksums``)
        if not finite:
            raise SaveError(f"the training state at step {step} has non-finite values (NaN or Inf); it was not saved, "
                            f"so {self.directory} still ends with the last finite checkpoint. Lower the "
                            "learning rate or check the rewards, then resume")
        if self.rotate_before:
            self.wait()  # the newest must be complete before the oldest goes (a save waits for it anyway)
            older = [s for s in self.steps() if s != step]
            for old in older[:max(0, len(older) - (self.rotate_before - 1))]:
                self.manager.delete(old)
        meta = {**meta, "checksums": {"meta": _meta_checksum(meta), "arrays": dict(zip(_paths(state), sums))}}
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
        if not _has_optimizer(saved):  # a save_only_model checkpoint: the model's arrays are what must fit
            wanted = {k: v for k, v in wanted.items() if not k.startswith(OPTIMIZER + "/")}
        out = [(k, f"{k}: {saved[k]} in the checkpoint, {wanted[k]} configured") for k in wanted
               if k in saved and saved[k] != wanted[k]]
        out += [(k, f"{k}: configured, not in the checkpoint") for k in wanted if k not in saved]
        out += [(k, f"{k}: in the checkpoint, not configured") for k in saved if k not in wanted]
        return [line for k, line in sorted(out, key=lambda x: not x[0].startswith("params/"))]  # the model's first

    def has_optimizer(self, step: int) -> bool:
        """Whether checkpoint ``step`` holds the optimizer state (not a ``save_only_model`` one); True when its
        metadata cannot be read (the restore then finds out what is wrong with it)."""
        try:
            return _has_optimizer(_shapes(self.manager.item_metadata(step)["state"]))
        except Exception:  # noqa: BLE001 - unreadable metadata: for the restore to report
            return True

    def restore_latest(self, abstract_state):
        """``(step, state, meta)`` of the newest checkpoint that reads back intact, or None if there is none. A
        ``save_only_model`` checkpoint comes back with ``opt_state`` None (the caller starts a new optimizer).

        A checkpoint that fails to read (partial or corrupt) or whose arrays differ from the checksums saved with
        them (``damage``) is skipped for the previous one, with a warning, and moved aside to
        ``<step>.unreadable`` or ``<step>.damaged`` (kept for inspection, not deleted), so that the run can save
        that step again when it gets there. Checkpoints saved before checksums were kept restore unchecked."""
        skipped = []
        for step in reversed(self.steps()):
            try:
                model_only = _has_optimizer(_shapes(abstract_state)) and not self.has_optimizer(step)
                target = without_optimizer(abstract_state) if model_only else abstract_state
                state = ocp.args.PyTreeRestore(target, ocp.checkpoint_utils.construct_restore_args(target))
                out = self.manager.restore(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
                skipped.append((step, self._aside(step, "unreadable")))
                log.warning("checkpoint %s/%d is unreadable (%s: %s); trying the previous one", self.directory, step,
                            type(e).__name__, e)
                continue
            wrong = damage(out.state, out.meta)
            if wrong is None:
                break
            skipped.append((step, self._aside(step, "damaged")))
            log.warning("checkpoint %s/%d is damaged: %s; it is moved aside to %s, trying the previous one",
                        self.directory, step, wrong, skipped[-1][1])
            out = None  # the damaged state's buffers go before the previous checkpoint is read
        else:
            out = None
        if skipped:
            if jax.process_index() == 0:
                for s, aside in skipped:
                    (self.directory / str(s)).rename(aside)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("jodpo: unreadable checkpoints moved aside")
            self.manager.reload()
        if out is None:
            return None
        meta = dict(out.meta)
        if meta.pop("checksums", None) is None:
            log.info("checkpoint %s/%d has no checksums (saved before jodpo kept them): restored unchecked",
                     self.directory, step)
        return step, out.state, meta

    def _aside(self, step: int, why: str) -> Path:
        aside = self.directory / f"{step}.{why}"
        while aside.exists():
            aside = aside.with_name(aside.name + "~")
        return aside

    def close(self) -> None:
        self.wait()
        self.manager.close()


OPTIMIZER = "opt_state"  # the TrainState field that save_only_model leaves out


def without_optimizer(state):
    """``state`` (a ``TrainState``, or a dict of its fields) without its optimizer state: a None subtree, which holds
    no arrays."""
    return {**state, OPTIMIZER: None} if isinstance(state, dict) else state.replace(**{OPTIMIZER: None})


def _has_optimizer(shapes: dict[str, tuple]) -> bool:
    return any(k.startswith(OPTIMIZER + "/") for k in shapes)


def _shapes(tree) -> dict[str, tuple]:
    """{"params/layers/attn/q": shape} of a state, its ShapeDtypeStructs or Orbax's metadata of it alike (a
    dataclass's fields, a named tuple's names and dict keys all read as names; None subtrees hold nothing)."""
    tree = getattr(tree, "tree", tree)  # Orbax's tree metadata wraps the tree
    return dict(zip(_paths(tree), (tuple(leaf.shape) for leaf in jax.tree.leaves(tree))))


def _paths(tree) -> list[str]:
    """The leaves' names, in ``jax.tree.leaves`` order: "params/layers/attn/q"."""
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    return ["/".join(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


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
    them: only ``state/params`` is read (and checked against its checksums: a damaged one is not readable)."""
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
        out = ckptr.restore(path, args=ocp.args.Composite(state=args, meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; the caller needs one
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    wrong = damage({"params": out["state"]["params"]}, out["meta"])
    if wrong is not None:
        raise CheckpointError(f"{path} is damaged: {wrong}")
    return out["state"]["params"]


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

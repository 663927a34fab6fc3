"""The run directory (``output_dir``): checked and created before anything is read, and locked for the run's life.

Two runs writing one ``output_dir`` at once tear each other's checkpoints and interleave ``metrics.jsonl``, so a
run holds ``output_dir/jodpo.lock`` (created exclusively; it names the holder's host and pid) from its start to its
exit, whatever the exit. A run killed without a chance to release it (SIGKILL, a lost VM) leaves the file behind:
on the same host a lock whose pid is no longer alive is stale and taken over; a lock held from another host is
refused with what it says, since no process of that host can be asked. In a multi-process run process 0 takes the
lock for the job and tells the others whether it did.

What an earlier start left there is checked before it is resumed: the config (``config.json``), and whether the
newest checkpoint's arrays fit the configured model (an intact checkpoint of another model is refused, never set
aside as unreadable); ``source_model/`` is rewritten at every start from the configured model.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from jodpo.errors import ConfigError, RunDirError
from jodpo.program.config import TrainConfig
from jodpo.models.export import write_metadata

LOCK_NAME = "jodpo.lock"



def prepare(output_dir: str) -> tuple[Path, list[Path]]:
    """``output_dir`` as an absolute path (``~`` expanded), created if missing, refused in one line if it is empty,
    an existing file, or cannot be created or written; and the directories it created, outermost first (``discard``
    removes them again if the run fails before it writes anything). Made at once, not once the models have loaded:
    a directory that cannot be used is said before a minute of loading, with the operating system's own reason."""
    if not output_dir.strip():
        raise RunDirError("output_dir is empty: the run would write into the current directory; give a directory "
                          "(--config.output_dir=runs/NAME)")
    out = Path(output_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output_dir {str(out)!r} is an existing file, not a directory; choose another path")
    created = [d for d in (*reversed(out.parents), out) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        discard(created)
        raise RunDirError(f"output_dir {str(out)!r} cannot be created ({e.strerror or e}); choose a directory on a "
                          "writable filesystem") from None
    return out, created


def discard(created: list[Path]) -> None:
    """Remove the directories ``prepare`` made, innermost first, each only while it is empty (``rmdir``): a run
    that failed before writing leaves nothing behind, and nothing anyone else put there is ever removed."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): it stays, and so do its parents
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


class RunLock:
    """``output_dir/jodpo.lock``: ``acquire()`` or a ``RunDirError`` naming the directory and the holder."""
    def __init__(self, output_dir: Path):
        self.directory = Path(output_dir)
        self.path = self.directory / LOCK_NAME
        self.held = False

    def acquire(self) -> "RunLock":
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):  # a stale lock is taken over once; a race for it is lost to whoever won
            try:
                self._create(json.dumps(me))
            except FileExistsError:
                holder = self._holder()
                if holder is None or self._stale(holder):
                    self._set_aside()
                    continue
                raise RunDirError(f"output_dir {str(self.directory)!r} is in use by another run (pid {holder['pid']} "
                                  f"on {holder['host']}, since {holder.get('since', '?')}); wait for it to end or use "
                                  f"another output_dir (if that process is gone, delete {self.path})") from None
            except OSError as e:
                raise RunDirError(f"output_dir {str(self.directory)!r} is not writable ({e.strerror or e}); choose a "
                                  "directory on a writable filesystem") from None
            self.held = True
            return self
        raise RunDirError(f"output_dir {str(self.directory)!r}: could not take {self.path} (other runs are starting "
                          "there); start one run per output_dir")

    def _create(self, text: str) -> None:
        """The lock file, appearing whole: written aside and hard-linked into place (the link fails if the lock
        exists), so no run ever reads a lock that its holder is still writing. Where the filesystem has no hard
        links, an exclusive create, then the write."""
        tmp = self.path.with_name(f"{LOCK_NAME}.{socket.gethostname()}.{os.getpid()}")
        tmp.write_text(text)
        try:
            os.link(tmp, self.path)
            return
        except FileExistsError:
            raise
        except OSError:  # no hard links here
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        finally:
            tmp.unlink(missing_ok=True)

    def _holder(self) -> dict | None:
        """What the lock file says, or None when it cannot say it (torn: a process killed while writing it, where the
        filesystem has no hard links)."""
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
        except FileNotFoundError:
            return {"host": "", "pid": -1}  # released meanwhile: stale, so try again
        except (OSError, ValueError):
            return None

    @staticmethod
    def _stale(holder: dict) -> bool:
        return holder["pid"] < 0 or holder.get("host") == socket.gethostname() and not _alive(holder["pid"])

    def _set_aside(self) -> None:
        """Remove a stale lock. Renamed first: of several runs finding it stale, one rename succeeds, and the
        others then find the lock the winner took."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
            aside.unlink()
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_for_job(out: Path) -> RunLock | None:
    """The run's lock, taken by process 0 of the job (the others get None). Every process raises if process 0 could
    not take it, so that no process goes on alone."""
    import jax

    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(out).acquire()
        except RunDirError as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            error = RunDirError(f"output_dir {str(out)!r}: process 0 could not lock it (its message says why)")
    if error is not None:
        raise error
    return lock


# --------------------------------------------------------------------------------------------------
# What the directory holds from an earlier start: the config, the checkpoints' model, source_model/
# --------------------------------------------------------------------------------------------------


def check_same_config(out: Path, cfg) -> None:
    saved = out / "config.json"
    if not saved.exists():
        return
    new = json.loads(json.dumps(cfg.to_dict()))
    # a field added to jodpo after the run started reads as its default (which is what the run used)
    old = json.loads(json.dumps(TrainConfig().to_dict())) | json.loads(saved.read_text())
    # where things are kept, how much of them, and where they are reported or published, is not what the run computes
    # (a disk filling up is fixed by resuming with save_only_model)
    moved = ("output_dir", "compilation_cache_dir", "report_to", "run_name", "save_only_model", "push_to_hub",
             "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_revision")
    changed = sorted(k for k in new if old.get(k) != new[k] and k not in moved)
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed[:6])
        raise ConfigError(f"{out} holds a run with a different config ({detail}); resume with the saved config, "
                          "use a new output_dir, or pass --allow_config_change to resume with the new one")


def check_fits(ckpt, step: int, layout, out: Path) -> None:
    diffs = ckpt.misfit(step, layout)
    if diffs:
        more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise ConfigError(f"{ckpt.directory}/{step} holds a run whose state does not fit the configured model "
                          f"({'; '.join(diffs[:3])}{more}); resume with the config it was trained with "
                          f"({out / 'config.json'}), or use a new output_dir for this model")


def write_source_model(model, tokenizer, target: Path) -> None:
    """The policy's config and tokenizer (no weights) in ``output_dir/source_model``: what
    ``scripts/export_hf.py`` needs besides the checkpoint, without the hub or the original directory. Written at
    every start (a resume with ``--allow_config_change`` may have changed them), aside then renamed."""
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_metadata(model, tmp, tokenizer)
    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)

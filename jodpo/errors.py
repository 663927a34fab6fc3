"""The exceptions that more than one module raises or catches. A leaf: it imports nothing of jodpo.

Every message names the field or file, the problem and the fix; the commands print it in one line (``--debug``
shows the traceback)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run: the message names the field and the fix."""


class RunDirError(ConfigError):
    """``output_dir`` cannot be used: not creatable, a file, or in use by another run."""


class CheckpointError(ValueError):
    """A checkpoint (a model directory, a ``.gguf`` file, a run's Orbax step) that cannot be used, with the reason
    and the fix in the message."""


class UnsupportedModelError(ValueError):
    """A checkpoint of an architecture, activation or RoPE scaling that jodpo does not implement."""


class ExportMismatch(RuntimeError):
    """The written checkpoint does not reproduce the parameters or logits it was written from."""


class DataError(ValueError):
    """A dataset that cannot be used; the message names the problem and the fix."""


class RewardError(ValueError):
    """A reward function that raised or returned something other than a number (or None) per completion."""


class JudgeError(ValueError):
    """A judge that cannot run as configured (the message names the field)."""


class MeshError(ValueError):
    """A mesh that does not fit the devices, or a batch that does not fit the mesh."""


class BackendError(ValueError):
    """A setting that can no longer take effect in this process."""


class SaveError(RuntimeError):
    """A checkpoint that was not written (disk full, a non-finite state); the previous ones are intact."""


class GenerateError(ValueError):
    """Bad input to generate or evaluate (the message names the file or flag and the fix)."""


class Stopped(Exception):
    """A signal (preemption, Ctrl-C) stopped the run after it saved a checkpoint: the same command resumes."""


class Diverged(RuntimeError):
    """Too many updates in a row were skipped for a non-finite loss or gradient norm."""


class HubError(RuntimeError):
    """A push to the Hub (``push_to_hub``) that failed; the run's checkpoints are intact."""

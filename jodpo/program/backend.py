"""What the training program sets up in XLA before jax touches a device: deterministic GPU kernels (when asked),
the persistent compilation cache, and enough CPU threads for the collectives of several CPU devices.

Numbers and backends (docs/gpu.md, "Precision" and "Determinism"):
  - float32 dots are computed in float32 on every backend (``Model.precision``, ``matmul_precision``);
  - a CPU run is bitwise reproducible, killed and resumed included, with no setting;
  - a GPU run is bitwise reproducible with ``deterministic=True`` (XLA's deterministic ops: no atomics in
    reductions and scatters, no autotuning, so a restarted process compiles the same kernels); without it,
    a resumed run stays within a few float32 ulps a step of the uninterrupted one and drifts apart slowly,
    as any two GPU runs do;
  - TPU programs are deterministic by default (XLA:TPU has no atomics), so resume is bitwise there too.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import jax

from jodpo.errors import BackendError
from jodpo.program import hostmem

log = logging.getLogger("jodpo")

DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"



def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def set_deterministic() -> None:
    """Make XLA's GPU kernels deterministic (``--xla_gpu_deterministic_ops``); a no-op on CPUs and TPUs, which are
    deterministic already. Must run before jax starts its backends: XLA reads its flags once."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_deterministic_ops" in flags:
        return
    if _backends_started() and jax.default_backend() == "gpu":
        raise BackendError("deterministic=True must be set before jax starts the GPU, and it already has in this "
                           f"process; start it with XLA_FLAGS={DETERMINISTIC_FLAG} in the environment")
    os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_FLAG}".strip()


# XLA:CPU runs every device's part of a program on the threads of one pool, and a collective holds its thread until
# every device has reached it. The pool has as many threads as devices (on a machine with fewer cores): enough for one
# collective at a time per device, which is all XLA counts on. But XLA's executor runs a collective outside a loop as
# soon as its operands are ready, while the loop it was scheduled after (the layers' scan of the loss, whose every
# step all-reduces) is still running: then a device holds two threads, one device gets none, and no collective ever
# completes (issue 53: XLA aborts after 40 s). Which device runs what first depends on timing, cold or warm cache
# alike. Four threads a device leave room for every device to wait in as many collectives at once as the programs
# here ever reach (two seen; with two threads a device the abort never came back). The threads wait; they do not
# compute.
THREADS_PER_CPU_DEVICE = 4
NPROC = "NPROC"  # XLA's override of its CPU thread pools' size (xla/pjrt/utils.cc DefaultThreadPoolSize)


def cpu_devices_asked() -> int:
    """How many CPU devices jax will make: ``jax_num_cpu_devices`` (``JAX_NUM_CPU_DEVICES``), else XLA's
    ``--xla_force_host_platform_device_count``, else 1. Read before jax starts its backends."""
    asked = jax.config.jax_num_cpu_devices
    if asked > 0:
        return asked
    flags = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(flags[-1]) if flags else 1


def cpu_threads_for(devices: int) -> int:
    return min(THREADS_PER_CPU_DEVICE * devices, 256)  # 256: XLA's own cap on the pool


def _nproc() -> int:
    """``NPROC`` as XLA reads it (an integer; anything else counts as unset)."""
    value = os.environ.get(NPROC, "")
    return int(value) if value.strip().isdigit() else 0


def set_cpu_threads() -> None:
    """Give XLA:CPU's thread pools ``THREADS_PER_CPU_DEVICE`` threads a device where jax will make several CPU devices
    (``NPROC``, unless it asks for more already). Must run before jax starts its backends; a no-op with one device."""
    devices = cpu_devices_asked()
    if devices > 1 and not _backends_started():
        want = cpu_threads_for(devices)
        if _nproc() < want:
            os.environ[NPROC] = str(want)


def cpu_threads_warning() -> str | None:
    """A line saying that this process's CPU devices may deadlock in a collective, where jax started them with too
    few threads (a script that made several CPU devices before jodpo could ``set_cpu_threads``); None where all is
    well. Read from ``NPROC``, as XLA read it when it started."""
    if jax.default_backend() != "cpu" or jax.local_device_count() == 1:
        return None
    want = cpu_threads_for(jax.local_device_count())
    if _nproc() >= want:
        return None
    return (f"warning: jax started {jax.local_device_count()} CPU devices with fewer than {want} threads, and XLA:CPU "
            "can then deadlock in a collective (docs/troubleshooting.md); start the process with "
            f"NPROC={want} in its environment, or call jodpo.program.backend.set_cpu_threads() before jax starts")


def start_command() -> None:
    """What every command-line program does first (``import jodpo`` does none of it): XLA:CPU's threads for several
    devices (``set_cpu_threads``), then the rest below.

    transformers' advisory warnings go off (unless the environment sets them): where torch is not installed (jodpo
    needs none; the README's first command installs none), importing transformers says "PyTorch was not found.
    Models won't be available...", true of transformers' models and misleading as a run's first line: the models
    here are jodpo's own. Its warnings proper are still shown. And the compiler's freed scratch memory goes back to
    the OS after each compilation (``hostmem``)."""
    set_cpu_threads()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    hostmem.install()


def one_line_warnings(command: str) -> None:
    """A command's own way of saying jodpo's warnings: ``jodpo.train: <the message>``, one line like its other notes,
    not Python's ``path/to/jodpo/module.py:198: UserWarning: ...`` with the source line under it. Warnings that other
    code raises print as Python prints them; only their format changes (``warnings.formatwarning``), so filters and
    recorders see them as before. Only the commands call this: a script keeps Python's format."""
    import warnings

    package = str(Path(__file__).resolve().parents[1])
    python_format = getattr(warnings.formatwarning, "python_format", warnings.formatwarning)

    def one_line(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(package):
            return f"{command}: {message}\n"
        return python_format(message, category, filename, lineno, line)

    one_line.python_format = python_format  # a second call (a test's second run) replaces, never stacks
    warnings.formatwarning = one_line


CACHE_MAX_BYTES = 32 * 2**30
CACHE_LOCK_TIMEOUT_S = 60.0


def default_cache_dir() -> Path:
    return Path(os.environ.get("JODPO_CACHE", Path.home() / ".cache" / "jodpo")) / "xla"


def set_compilation_cache(directory: str | None, min_compile_time_secs: float | None = None) -> Path | None:
    """Keep compiled programs in ``directory`` across processes (jax's persistent compilation cache), so a
    restarted or resumed run skips its compiles. ``"auto"``: a directory already given to jax
    (``JAX_COMPILATION_CACHE_DIR``) or else ``$JODPO_CACHE/xla`` (``~/.cache/jodpo/xla``); ``None`` or ``""``:
    off. Programs that compile in under ``min_compile_time_secs`` are not worth a file and are not kept (None: jax's
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` where the environment sets it, else 0.5 s)."""
    from jax._src import compilation_cache

    if min_compile_time_secs is None:
        min_compile_time_secs = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.5))

    if directory == "auto":
        directory = jax.config.jax_compilation_cache_dir or str(default_cache_dir())
    path = Path(directory).expanduser().absolute() if directory else None
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        _date_unlimited_entries(path)
    jax.config.update("jax_compilation_cache_dir", str(path) if path else None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
    # A size limit turns on jax's file lock around every read and write of the cache: without one, a process can read
    # an entry another is still writing (the hosts of a job on one disk, or the test suite's two workers), and
    # recompile with a warning. 32 GiB, the least recently used programs evicted past it.
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    # jax reads the directory and the limit once, at its first compile: start over so that these are used from now on
    # (also when the directory is the one jax already had, from JAX_COMPILATION_CACHE_DIR: jax's own default, 1 s and
    # no limit, no lock, held until this reset)
    compilation_cache.reset_cache()
    return path


def _date_unlimited_entries(path: Path) -> None:
    """Give each program that jax kept in ``path`` without a size limit (a process with JAX_COMPILATION_CACHE_DIR and
    jax's defaults) the last-use time that jax's eviction reads for every entry once a limit is set: without it each
    write into the directory fails (jax warns and keeps nothing). Dated by the file's own time, under jax's lock."""
    import warnings

    import filelock
    from jax._src import lru_cache

    try:
        with filelock.FileLock(path / ".lockfile", timeout=CACHE_LOCK_TIMEOUT_S):
            for entry in path.glob(f"*{lru_cache._CACHE_SUFFIX}"):
                used = entry.with_name(entry.name.removesuffix(lru_cache._CACHE_SUFFIX) + lru_cache._ATIME_SUFFIX)
                if not used.exists():
                    used.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
    except (OSError, filelock.Timeout) as e:  # a read-only directory, or one whose lock another process keeps
        warnings.warn(f"compilation cache {path}: its programs could not be dated for jax's eviction ({e}); the run "
                      "goes on, and jax may keep no new program there", stacklevel=3)


def cache_for_this_job() -> str | None:
    """Turn the compilation cache off in a multi-process job on CPUs, once the job is joined; returns the line that
    says so (None where nothing changed). There jax keys a program by the process's own devices, so only process 0
    finds the programs it wrote: with a warm cache it runs the executable it reads while the others run the one they
    compile, and the two wait on each other's collectives for ever (seen with 2 processes x 4 CPU devices and gloo:
    a restart hung at its first step). A cold cache is safe (every process compiles), so the cache is off for the
    whole job instead. Jobs on GPUs and TPUs keep it."""
    if jax.process_count() == 1 or jax.default_backend() != "cpu" or not jax.config.jax_compilation_cache_dir:
        return None
    set_compilation_cache(None)
    return ("compilation cache off: a multi-process job on CPUs compiles its programs in every process (a cached "
            "program read by one process and compiled by another deadlocks their collectives)")


def attention_kernel(cfg, model) -> str:
    """The attention kernel of a run's forwards and prefill: ``cfg.attn_implementation``, with ``"auto"`` resolved to
    cuDNN's flash attention where it is known to run and to pay (measured on an H200 at a 1.76B GPT-NeoX shape in bf16:
    the update 1.45x faster than jodpo's XLA attention; docs/gpu.md): jax's backend an NVIDIA GPU of compute capability
    8.0 or more, bf16 compute, heads of at most 128 dims, no soft-capping, and ``deterministic=False`` (cuDNN's
    backward is not among XLA's deterministic ops). On TPUs in bf16, splash attention (its temporaries grow with the
    sequence, not its square: docs/tpu.md). Everywhere else, jodpo's own XLA attention."""
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    if jax.default_backend() == "tpu":  # splash attention (jodpo.models.splash), as every TPU stack's, in bf16
        return "splash" if cfg.bf16 else "xla"
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        capability = float(getattr(jax.devices()[0], "compute_capability", 0) or 0)
    except ValueError:  # not a CUDA device
        capability = 0.0
    # every attention kind's heads (Gemma 4's global layers: 512), not only the model's default
    head_dim = max([model.attention_of(k).head_dim for k in dict.fromkeys(model.kinds) if k != "deltanet"] or [0])
    fits = capability >= 8.0 and head_dim <= 128 and not model.attn_softcap
    return "cudnn" if fits and cfg.bf16 and not cfg.deterministic else "xla"


def decode_attention_kernel(cfg) -> str:
    """The attention of a run's decode steps: ``cfg.decode_attn_implementation``, with ``"auto"`` resolved to the
    Pallas kernel that reads only the filled cache blocks (``jodpo.models.decode_attention``) on TPUs, where it
    compiles with Mosaic, and jodpo's XLA attention elsewhere (on other backends the kernel runs only in Pallas'
    interpret mode: the tests')."""
    if cfg.decode_attn_implementation != "auto":
        return cfg.decode_attn_implementation
    return "pallas" if jax.default_backend() == "tpu" else "xla"


def configure(cfg) -> None:
    """Everything a ``TrainConfig`` sets in XLA itself; call it before any device work."""
    if cfg.deterministic:
        set_deterministic()
    set_compilation_cache(cfg.compilation_cache_dir)


def prepare(cfg) -> list[str]:
    """The whole set-up of a training program, whichever way it started (``python -m jodpo.train``, a script's
    ``OnlineDPOTrainer(...).train()``): ``start_command``, then ``configure`` (the compilation cache, determinism),
    then ``cache_for_this_job``. Call it once a multi-process job is joined and before the devices are used; again is
    harmless. Returns the lines to show (process 0's to print), each once: the multi-process cache note, the CPU
    threads warning of a script that started jax itself."""
    start_command()
    configure(cfg)
    said = cache_for_this_job()
    warning = cpu_threads_warning()
    lines = [line for line in (said, warning) if line and line not in _said]
    _said.update(lines)
    return lines


_said: set[str] = set()

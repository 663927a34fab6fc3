"""Environments of the tests' subprocesses."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env(**extra: str) -> dict:
    """This process's environment, with jodpo importable."""
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def cpu_env(devices: int, **extra: str) -> dict:
    """A subprocess on ``devices`` fake CPU devices, whatever jax's default backend is here (a GPU machine too):
    the CPU platform is pinned and the device count added to the XLA flags already set. XLA's CPU threads are sized
    for the devices' collectives as ``python -m jodpo.train`` sizes them (``backend.set_cpu_threads``), since most of
    these subprocesses start jax before any of jodpo runs."""
    from jodpo.program import backend

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    threads = {backend.NPROC: str(backend.cpu_threads_for(devices))} if devices > 1 else {}
    return env(**{"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **threads, **extra})


def on_one_core(proc: subprocess.Popen) -> subprocess.Popen:
    """``proc`` pinned to one core, with the threads it starts from now on (XLA's: a Python process starts them long
    after this): the load of a busy host, where XLA:CPU's threads take turns and what depends on their timing shows
    (issue 63's 2-process abort, 3 runs of 3, as with a CPU hog beside it). Left as it is where the OS cannot pin."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(proc.pid, {min(os.sched_getaffinity(0))})
    return proc


# The suite's compiler flags on a machine without an accelerator (tests/conftest.py: compiled for speed of compiling)
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def compiled_as_a_run(environ: dict) -> dict:
    """``environ`` with the suite's fast-compile flags removed: its programs compiled as a run compiles them (some
    faults show only in those programs)."""
    flags = [f for f in environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS]
    return dict(environ, XLA_FLAGS=" ".join(flags))


_TORCH = {"torch", "functorch", "torchgen"}


def _site_without_torch() -> Path:
    """A view of this process's packages without torch (a symlink to every other entry of each packages directory
    on sys.path), built once per test session in its cache and shared by the pytest-xdist workers."""
    view = Path(os.environ["JODPO_TEST_SESSION_CACHE"]) / "site-without-torch"
    if view.is_dir():
        return view
    given = os.environ.get("PYTHONPATH", "").split(os.pathsep)  # e.g. a `pip install --target` directory
    tmp = Path(tempfile.mkdtemp(prefix="site-", dir=view.parent))
    for directory in sys.path:
        if not (directory.endswith("-packages") or directory in given) or not Path(directory).is_dir() or \
                Path(directory).resolve() == ROOT:
            continue
        for entry in Path(directory).iterdir():
            link = tmp / entry.name
            if re.split(r"[-.]", entry.name)[0] not in _TORCH and not link.exists() and not link.is_symlink():
                link.symlink_to(entry)
    try:
        tmp.rename(view)
    except OSError:  # another worker made it first
        shutil.rmtree(tmp)
    return view


def without_torch(env: dict) -> tuple[list[str], dict]:
    """The interpreter command and environment of a subprocess that cannot import torch: the environment the
    README's first command installs (torch and the references are the test extra's). Python starts without its
    site directories (``-S``) and imports from the checkout and the view above. transformers imports torch whenever
    it is installed, which a run's process never needs (measured side by side: test_reliability's worker time 99 ->
    83 s; with a warm page cache the whole suite's gain is within the machine's noise)."""
    path = os.pathsep.join([str(ROOT), str(_site_without_torch())])
    return [sys.executable, "-S"], dict(env, PYTHONPATH=path)


WALL_CLOCK = ("eps", "rollout/generated_tok_s")  # metrics of the wall clock: never the same in two runs


def metrics_lines(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def start_tiny(out: Path, *extra: str, environ: dict | None = None) -> subprocess.Popen:
    """The README's first command (tiny.py), in an environment without torch as that command installs it
    (``environ``: the process's environment, default ``env()``)."""
    python, environ = without_torch(env() if environ is None else environ)
    cmd = [*python, "-m", "jodpo.train", "--config", "tiny.py", f"--config.output_dir={out}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(cond, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.02)

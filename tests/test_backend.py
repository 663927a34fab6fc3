"""jodpo.program.backend: deterministic GPU kernels and the persistent compilation cache, set up before jax starts;
and the run's precision (and its frozen models' compute form) reaching every model it builds."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache

from jodpo.program import backend
from jodpo.program import run
from jodpo.program.config import TrainConfig
from tests import hf_fixtures, subproc


def test_deterministic_sets_xla_flags_before_jax_starts():
    code = ("import os, jax\n"
            "from jodpo.program import backend\n"
            "from jodpo.program.config import TrainConfig\n"
            "backend.configure(TrainConfig(deterministic=True, compilation_cache_dir=None))\n"
            "flags = os.environ['XLA_FLAGS'].split()\n"
            "assert '--xla_force_host_platform_device_count=2' in flags and backend.DETERMINISTIC_FLAG in flags\n"
            "assert jax.device_count() == 2\n"  # XLA read the flags after: the device count proves it
            "backend.configure(TrainConfig(deterministic=True, compilation_cache_dir=None))\n"
            "assert os.environ['XLA_FLAGS'].split() == flags\n"  # idempotent, and harmless once started on a CPU
            "print('OK')\n")
    env = subproc.cpu_env(2)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if "deterministic" not in f)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


_THREADS = ("import os, jax\n"
            "from jodpo.program import backend\n"
            "{start}"
            "jax.devices()\n"
            "tasks = os.listdir('/proc/self/task')\n"
            "pool = sum('XLAEigen' in open(f'/proc/self/task/{{t}}/comm').read() for t in tasks)\n"
            "print('THREADS', jax.device_count(), os.environ.get('NPROC'), pool, backend.cpu_threads_warning())\n")


def _threads(devices: int, start: str, **extra: str) -> list[str]:
    environ = subproc.cpu_env(devices)
    environ.pop("NPROC", None)  # the test's to set
    environ.update(extra)
    done = subprocess.run([sys.executable, "-c", _THREADS.format(start=start)], capture_output=True, text=True,
                          env=environ, timeout=120)
    assert done.returncode == 0 and "THREADS" in done.stdout, done.stderr[-3000:]
    return done.stdout.split("THREADS ")[-1].strip().split(" ", 3)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts XLA's threads in /proc (Linux)")
def test_a_command_gives_xla_cpu_four_threads_a_device_for_its_collectives():
    """Issue 53: XLA:CPU held a thread per device in each collective from a pool of as many threads as devices, and
    its executor could start a second collective on a device before the first ended: all threads waited, and XLA
    aborted. A command (``start_command``, before jax starts) asks for four a device; one device is left as it is,
    and a larger NPROC is kept."""
    assert _threads(8, "backend.start_command()\n") == ["8", "32", "32", "None"]
    assert _threads(8, "backend.start_command()\n", NPROC="48") == ["8", "48", "48", "None"]
    assert _threads(1, "backend.start_command()\n")[:2] == ["1", "None"]
    # jax started first (a script of its own): too late to set, so training warns, once jax is up
    devices, nproc, pool, warning = _threads(8, "jax.devices()\nbackend.start_command()\n")
    assert (devices, nproc, pool) == ("8", "None", "8")
    assert warning.startswith("warning: jax started 8 CPU devices with fewer than 32 threads"), warning


def _the_suites_cache():
    """The suite's compilation cache again (tests/conftest.py), as "auto" chose it when jax had no directory."""
    backend.set_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(backend.default_cache_dir()))


@pytest.fixture
def cache_hits():
    hits = []

    def listen(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    yield hits
    jax.monitoring.unregister_event_listener(listen)
    _the_suites_cache()


def _compile_fresh(n: int = 64):
    """A new jitted function each time (no in-memory cache hit), the same program each time (for each ``n``)."""
    return jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(jnp.ones((n, n))).compile()


def test_the_compilation_cache_keeps_programs_across_processes(tmp_path, cache_hits):
    assert backend.set_compilation_cache(str(tmp_path / "xla"), min_compile_time_secs=0) == tmp_path / "xla"
    _compile_fresh()
    written = list((tmp_path / "xla").iterdir())
    assert written and not cache_hits
    # bounded, hence read and written under jax's file lock (processes sharing the directory never read half a file)
    assert jax.config.jax_compilation_cache_max_size == backend.CACHE_MAX_BYTES
    assert (tmp_path / "xla" / ".lockfile").exists()
    backend.set_compilation_cache(str(tmp_path / "xla"), min_compile_time_secs=0)  # as a new process would
    _compile_fresh()
    assert len(cache_hits) == 1
    assert backend.set_compilation_cache(None) is None  # off: nothing read or written
    _compile_fresh()
    assert len(cache_hits) == 1 and sorted((tmp_path / "xla").iterdir()) == sorted(written)
    # "auto" with the directory already jax's (JAX_COMPILATION_CACHE_DIR, read when jax starts), which a process with
    # jax's defaults (1 s, no size limit) wrote a program into: the same settings, and the directory still written to
    env = tmp_path / "env"
    jax.config.update("jax_compilation_cache_dir", str(env))
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    _compile_fresh()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    assert len(list(env.glob("*-cache"))) == 1 and not list(env.glob("*-atime"))
    assert backend.set_compilation_cache("auto", min_compile_time_secs=0) == env
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jax warns where it cannot write an entry
        _compile_fresh(32)
    kept = lambda suffix: {f.name.removesuffix(suffix) for f in env.glob(f"*{suffix}")}  # noqa: E731
    assert (env / ".lockfile").exists() and len(kept("-cache")) > 1 and kept("-cache") == kept("-atime")


def test_auto_cache_dir_follows_jodpo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JODPO_CACHE", str(tmp_path))
    assert backend.default_cache_dir() == tmp_path / "xla"


def test_the_run_builds_every_model_with_its_precision(checkpoints, tmp_path):
    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    cfg = TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                      reward_model_path=str(checkpoints["llama"]["reward"]), dataset_name=str(data),
                      max_new_tokens=4, max_length=160, max_prompt_length=128, matmul_precision="high")
    built = run.build(cfg)
    assert built.step_cfg.model.precision == "high" and built.step_cfg.reward_model.precision == "high"


@pytest.mark.parametrize("use_peft", [False, True])
def test_the_run_keeps_its_frozen_models_in_their_compute_form(checkpoints, tmp_path, use_peft):
    """bf16 compute: the reference and the reward model are kept as their forwards read them (weights in bf16, norms
    as loaded; models.params.frozen_params), the policy it trains in float32; a LoRA base stays as loaded (its
    adapters are merged into it in float32)."""
    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    built = run.build(TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                                  reward_model_path=str(checkpoints["llama"]["reward"]), dataset_name=str(data),
                                  max_new_tokens=4, max_length=160, max_prompt_length=128, bf16=True,
                                  use_peft=use_peft))
    dtypes = lambda p: {str(x.dtype) for x in jax.tree.leaves(p)}  # noqa: E731
    assert dtypes(built.ref_params["layers"]["mlp"]) == ({"float32"} if use_peft else {"bfloat16"})
    assert dtypes(built.ref_params["layers"]["ln1"]) == {"float32"}
    assert dtypes(built.rewards.params["layers"]["attn"]) == {"bfloat16"}
    assert built.rewards.params["score"].dtype == "bfloat16"
    assert dtypes(built.policy_params) == {"float32"}


def test_a_command_says_jodpos_warnings_in_one_line(monkeypatch):
    """Issue 59: a command's notices (a multimodal checkpoint's towers left out, ...) print as its other lines do,
    ``jodpo.train: <message>``, not as Python's ``.../jodpo/models/loading.py:286: UserWarning: ...`` with the
    source line; other code's warnings keep Python's format."""
    import warnings

    from jodpo.models import loading

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    backend.one_line_warnings("jodpo.train")
    backend.one_line_warnings("jodpo.train")  # a second run in the process: not stacked
    said = warnings.formatwarning("DIR: its vision tower (3 tensors) is left out", UserWarning, loading.__file__, 286)
    assert said == "jodpo.train: DIR: its vision tower (3 tensors) is left out\n"
    other = warnings.formatwarning("theirs", UserWarning, "/elsewhere/lib.py", 7)
    assert other.startswith("/elsewhere/lib.py:7: UserWarning: theirs")


def test_the_cache_threshold_is_half_a_second_unless_the_environment_sets_jax_s(tmp_path, monkeypatch):
    try:
        monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
        backend.set_compilation_cache(str(tmp_path / "xla"))
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
        backend.set_compilation_cache(str(tmp_path / "xla"))
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
    finally:
        monkeypatch.undo()
        _the_suites_cache()


def test_a_cache_whose_lock_another_process_keeps_starts_with_a_warning(tmp_path, monkeypatch):
    import filelock

    monkeypatch.setattr(backend, "CACHE_LOCK_TIMEOUT_S", 0.1)
    try:
        with filelock.FileLock(tmp_path / ".lockfile"), pytest.warns(UserWarning, match="could not be dated"):
            assert backend.set_compilation_cache(str(tmp_path)) == tmp_path
    finally:
        _the_suites_cache()

import atexit
import contextlib
import glob
import hashlib
import importlib.util
import os
import platform
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Real weights and text from the package index (jodpo/assets.py) stay in the user's cache between sessions
_USER_CACHE = Path(os.environ.get("JODPO_CACHE", Path.home() / ".cache" / "jodpo"))  # a worker finds both set
os.environ.setdefault("JODPO_ASSETS", str(_USER_CACHE / "assets"))
# So do the suite's compiled programs (jax's persistent compilation cache, read and written by every test process and
# subprocess, whose runs' compilation_cache_dir="auto" follows JAX_COMPILATION_CACHE_DIR): jax keys a program by its
# HLO, the XLA flags and the jax/XLA versions, so the next session compiles only the programs that changed, and a
# warm cache gives the same executables a cold one compiles. One directory per CPU model and instruction set (a
# CPU executable is machine code for the host's features, and a disk may move to another host). At 4 GiB it is
# emptied when a session starts. JAX_COMPILATION_CACHE_DIR= (empty) compiles everything, in the session's own
# cache, as a fresh machine does.
TEST_XLA_CACHE_MAX_BYTES = 4 * 2**30


def _cpu_signature() -> str:
    try:
        lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith(("vendor_id", "model name", "flags"))][:3]
    except OSError:  # not Linux
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla = _USER_CACHE / "xla-tests"
    if _xla.is_dir() and sum(f.stat().st_size for f in _xla.rglob("*") if f.is_file()) > TEST_XLA_CACHE_MAX_BYTES:
        shutil.rmtree(_xla, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_xla / _cpu_signature())
# The suite's programs are small and many: it keeps those that compile in 0.1 s or more (a run keeps those of 0.5 s),
# here and in its subprocesses. tests/test_models.py alone on a warm cache (2-core EPYC, 2026-12-02): 0.5 s: 235 s,
# 0.1 s: 173 s (XLA compiles 93 -> 39 s, reads 12 -> 18 s); jax's own 1 s, which the suite had by mistake: 254 s.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# The tiny world, the HF checkpoints and the session's shared runs (tiny_run), fresh per session and shared by its
# pytest-xdist workers: made by the first process (xdist's controller, or a lone pytest), which removes it at its end
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("JODPO_TEST_SESSION_CACHE"):
    os.environ["JODPO_CACHE"] = os.environ["JODPO_TEST_SESSION_CACHE"]
else:
    os.environ["JODPO_CACHE"] = os.environ["JODPO_TEST_SESSION_CACHE"] = tempfile.mkdtemp(prefix="jodpo-cache-")
    atexit.register(shutil.rmtree, os.environ["JODPO_CACHE"], ignore_errors=True)
# With a GPU as jax's default backend, the suite's runs are reproducible (its resume tests compare bitwise), here
# and in every subprocess; the flag does nothing on a CPU. tests/test_gpu.py checks the `deterministic` field
# itself without it.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
# On a machine without an accelerator, the suite's programs are compiled for speed of compiling: its models are
# tiny, so its time is compiling. LLVM's optimisations are off (a third of it), and XLA:CPU emits its fusions with
# its classic elemental emitters instead of the MLIR fusion emitters (half of what is left: 292 -> 149 s of CPU for
# tests/test_models.py and tests/test_pairing.py side by side). XLA's HLO passes, which decide fusion, layouts and
# precision, are unchanged, and both emitters compute the same float32 operations (their roundings may differ in
# the last bits, which every tolerance here allows: the tolerances come from the dtype). JODPO_TEST_FULL_OPT=1 compiles as
# a run does. An accelerator: a GPU (/dev/nvidia0...), a TPU (/dev/accel0... on v4/v5p, /dev/vfio/0... on
# v5e/v6e), or libtpu installed.
_ACCELERATOR = (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
                or importlib.util.find_spec("libtpu") is not None)
if not (_ACCELERATOR or os.environ.get("JODPO_TEST_FULL_OPT")):
    from tests.subproc import FAST_COMPILE_FLAGS

    os.environ["XLA_FLAGS"] += " " + " ".join(FAST_COMPILE_FLAGS)

import pytest

import jodpo
from jodpo.program.backend import CACHE_MAX_BYTES, set_compilation_cache
from tests import hf_fixtures

# Every child process of the suite that compiles (also those that never call jodpo's set_compilation_cache) bounds the
# cache as jodpo does: a process without a bound writes programs without the last-use file that a bounded one's
# eviction reads beside each entry, and that one's next write then fails (seen: 30 warnings a session)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(CACHE_MAX_BYTES))

# Every test process keeps its compiled programs in the suite's compilation cache (above; where the training runs and
# the subprocesses keep theirs): a program that another worker, a subprocess or an earlier session compiled is read,
# and so is one compiled again after _release_compiled_programs below cleared jax's in-memory caches.
set_compilation_cache("auto")


def pytest_addoption(parser):
    parser.addoption("--gpu-tests-on-cpu", action="store_true",
                     help="also run the tests marked gpu when jax's default backend is not a GPU (to check the tests)")
    parser.addoption("--given-order", action="store_true",
                     help="run the files in the order given on the command line (the device check's priorities), "
                          "not the slowest first")


# The files that take longest (most of their time compiling, or in subprocesses), longest first: pytest-xdist's
# --dist loadfile hands a worker the next file when it is nearly done with its last one, so these start at once,
# one per worker, and the many short files fill in behind them, instead of two long files ending the run on one
# worker while the other idles. Every other file keeps its place (alphabetical) behind them. Measured with
# `--durations=0` on 2 cores (the commit that last changed this list gives the times).
SLOWEST_FIRST = ("test_sharding.py", "test_collective_order.py", "test_train.py", "test_bench.py", "test_train_step.py", "test_reliability.py",
                 "test_real_model.py", "test_gguf.py", "test_bench_program.py", "test_models.py",
                 "test_export_script.py", "test_device_check.py", "test_sampling.py", "test_functional_guide.py",
                 "test_losses_vs_trl.py",
                 "test_errors.py", "test_pairing.py", "test_losses.py", "test_lora.py", "test_judges.py",
                 "test_evaluate.py", "test_generate.py", "test_training_eval.py", "test_trainer.py",
                 "test_fresh_install.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: checks that mean something only with a GPU as jax's default backend "
                                       "(precision, export at scale, determinism, bf16); skipped elsewhere")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the files in the order given below
        config.option.loadscopereorder = False  # (its default sorts them by their number of tests)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--given-order"):
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or config.getoption("--gpu-tests-on-cpu"):
        return
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU as jax's default backend (this one is {jax.default_backend()}); "
                                       "docs/gpu.md says how to run the suite on one")
        for item in gpu_items:
            item.add_marker(skip)


def _memory_mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled programs after a test once the process holds 10000 memory mappings. XLA:CPU maps memory
    for every program it compiles, and a pytest worker that compiles for a quarter of an hour passes Linux's
    default limit of 65530 mappings (vm.max_map_count): the next compilation then aborts inside XLA (seen at about
    30000 mappings after four minutes of tests/test_train_step.py). Clearing the caches unmaps most of them;
    fixtures keep their arrays. Below the threshold the next tests reuse the programs they share."""
    yield
    n = _memory_mappings()
    if n is None or n > 10000:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@contextlib.contextmanager
def _once_per_session(name: str):
    """Yields True to the first pytest-xdist worker of the session to ask (it builds ``$JODPO_CACHE/<name>``), False
    to the rest, which wait for it: they share the session's $JODPO_CACHE. A worker that failed or died while
    building leaves no mark, so the next one builds it again from scratch."""
    import fcntl

    root = Path(os.environ["JODPO_CACHE"])
    done = root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its holder dies
        first = not done.exists()
        if first:
            shutil.rmtree(root / name, ignore_errors=True)
        yield first
        if first:
            done.touch()


@pytest.fixture(scope="session")
def checkpoints():
    """{family variant: {"causal_lm": dir, "reward": dir}}, built once per test session and shared by its workers
    (12 s of torch models saved): tests read them, none writes into them."""
    root = Path(os.environ["JODPO_CACHE"]) / "hf"
    with _once_per_session("hf") as first:
        if first:
            return hf_fixtures.build_checkpoints(root)
    return hf_fixtures.checkpoint_dirs(root)


@pytest.fixture(scope="session")
def tokenizer_dir(checkpoints):
    return next(iter(checkpoints.values()))["causal_lm"]


@pytest.fixture(scope="session")
def tiny_run():
    """The embedded default (configs/tiny.py), run once to the end: 200 steps, checkpoints at 100 and 200. Run once
    per session by whichever pytest-xdist worker needs it first (the other waits for it, then reads the same
    directory), in the session's $JODPO_CACHE beside the tiny world it was trained on. Tests copy it to change it."""
    from jodpo import train

    out = Path(os.environ["JODPO_CACHE"]) / "tiny-run"
    with _once_per_session("tiny-run") as first:
        if first:
            assert train.main(["--config", "tiny.py", f"--config.output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def neox(checkpoints):
    return jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))

"""A run survives: SIGKILL at any moment then the same command finishes exactly as an uninterrupted run;
SIGTERM saves the current step and exits 0; a partial save left by a crash is ignored; NaN/Inf updates are
skipped and K in a row stop the run; a non-finite state is never saved."""
import json
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jodpo import train
from jodpo.program.checkpoint import restore_params
from tests import hf_fixtures, subproc

ROOT = Path(__file__).resolve().parents[1]


def _assert_same_as(reference: Path, out: Path) -> None:
    assert subproc.metrics_lines(out) == subproc.metrics_lines(reference)
    for a, b in zip(jax.tree.leaves(restore_params(reference / "checkpoints" / "200")),
                    jax.tree.leaves(restore_params(out / "checkpoints" / "200"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise


def test_sigkill_then_sigterm_then_the_same_command_finishes_as_if_never_interrupted(tiny_run, tmp_path):
    """One run stopped twice (the same 200 steps as one uninterrupted run, so the suite pays for one): SIGKILL at any
    moment loses only what was in flight, and a partial save left by a crash is ignored; SIGTERM saves the current
    step and exits 0; each time the same command resumes, and the run ends bit for bit as the uninterrupted one."""
    out = tmp_path / "stopped"
    proc = subproc.start_tiny(out, "--config.save_steps=20")
    subproc.wait_for(lambda: (out / "checkpoints" / "20").is_dir(), proc)
    proc.kill()  # SIGKILL: no handler runs; whatever was in flight (a step, a save) is lost
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    # As a crash in the middle of a save leaves it: a temporary directory that must be ignored.
    partial = out / "checkpoints" / "180.orbax-checkpoint-tmp-1763700000000000"
    partial.mkdir()
    (partial / "state").mkdir()
    (partial / "state" / "garbage").write_bytes(b"\0" * 100)
    proc = subproc.start_tiny(out, "--config.save_steps=20")
    # resumed from 20 and well past where the kill struck (a few steps after 20: lines past the restored step are
    # dropped on resume, so a line of step 60 is this process's)
    subproc.wait_for(lambda: (out / "metrics.jsonl").exists() and any(m["step"] >= 60 for m in subproc.metrics_lines(out)), proc)
    proc.send_signal(signal.SIGTERM)
    log, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in log
    line = [x for x in err.splitlines() if "stopped by SIGTERM" in x]
    m = re.search(r"jodpo.train: stopped by SIGTERM at step (\d+); saved (\S+); run the same command to resume", line[0])
    step = int(m.group(1))
    assert 20 <= step < 200 and Path(m.group(2)) == out / "checkpoints" / str(step) and Path(m.group(2)).is_dir()
    again = subproc.start_tiny(out, "--config.save_steps=20")
    log, err = again.communicate(timeout=600)
    assert again.returncode == 0 and f"resumed from {out / 'checkpoints'}/{step}" in log, err[-3000:]
    assert "PyTorch was not found" not in err  # transformers' advice, irrelevant to a run: not its first line
    _assert_same_as(tiny_run, out)


@pytest.fixture(scope="module")
def nan_policy(checkpoints, tmp_path_factory):
    """The NeoX checkpoint with one NaN in a weight: every loss is NaN."""
    d = tmp_path_factory.mktemp("nan") / "policy"
    shutil.copytree(checkpoints["neox"]["causal_lm"], d)
    tensors = load_file(d / "model.safetensors")
    name = next(k for k in tensors if k.endswith("mlp.dense_h_to_4h.weight"))
    tensors[name][0, 0] = np.nan
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _nan_argv(nan_policy, checkpoints, tmp_path, *extra):
    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    return ["--config", "tldr.py", f"--config.model_name_or_path={nan_policy}",
            f"--config.reward_model_path={checkpoints['neox']['reward']}", f"--config.dataset_name={data}",
            f"--config.output_dir={tmp_path / 'out'}", "--config.max_steps=6", "--config.per_device_train_batch_size=2",
            "--config.gradient_accumulation_steps=1", "--config.max_new_tokens=4", "--config.max_length=96",
            "--config.max_prompt_length=64", "--config.bf16=False", "--config.logging_steps=1", *extra]


def _run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m jodpo.train`` in a process of its own, as a user runs it (its output and exit code as they
    are, and none of a long-lived pytest worker's compiled programs: see conftest's _release_compiled_programs)."""
    python, env = subproc.without_torch(subproc.env())
    return subprocess.run([*python, "-m", "jodpo.train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_nonfinite_updates_are_skipped_and_k_in_a_row_stop_the_run(nan_policy, checkpoints, tmp_path):
    done = _run_cli(_nan_argv(nan_policy, checkpoints, tmp_path, "--config.max_nonfinite_steps=3",
                              "--config.save_steps=100"))
    rc, log, err = done.returncode, done.stdout, done.stderr
    assert rc == 1, err[-3000:]
    assert "step 1: non-finite loss or gradient norm, update skipped (1 in a row)" in log
    assert "jodpo.train: error: 3 updates in a row had a non-finite loss or gradient norm (up to step 3)" in err
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_update"] for m in logged] == [1.0] * len(logged) and len(logged) >= 3
    assert not list((tmp_path / "out" / "checkpoints").iterdir())


def test_a_nonfinite_state_is_never_saved(nan_policy, checkpoints, tmp_path):
    done = _run_cli(_nan_argv(nan_policy, checkpoints, tmp_path, "--config.save_steps=2"))
    rc, err = done.returncode, done.stderr
    assert rc == 1 and "the training state at step 2 has non-finite values (NaN or Inf); it was not saved" in err
    assert not list((tmp_path / "out" / "checkpoints").iterdir())


def test_an_unreadable_latest_checkpoint_is_set_aside_and_the_run_finishes(tiny_run, tmp_path, caplog):
    out = tmp_path / "damaged"
    shutil.copytree(tiny_run, out)
    for f in (out / "checkpoints" / "200" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    assert train.main(["--config", "tiny.py", f"--config.output_dir={out}"]) == 0
    assert "checkpoint" in caplog.text and "is unreadable" in caplog.text
    assert (out / "checkpoints" / "200.unreadable" / "state").is_dir()  # kept for inspection, not deleted
    _assert_same_as(tiny_run, out)  # resumed from 100 and wrote 200 again


def test_checkpoints_are_written_uncompressed_and_compressed_ones_still_restore(tmp_path):
    """Saves skip zstd (most of a save's CPU time, for 8% of the disk on float32 noise): 4 MB of zeros take 4 MB.
    A checkpoint written compressed (Orbax's default, jodpo's before) restores the same."""
    import orbax.checkpoint as ocp

    from jodpo.program.checkpoint import Checkpointer, abstract_like

    state = {"zeros": jax.numpy.zeros((1 << 20,), jax.numpy.float32), "w": jax.random.normal(jax.random.key(0), (64,)),
             "step": jax.numpy.int32(7)}
    ckpt = Checkpointer(tmp_path / "new")
    ckpt.save(1, state, {"step": 1})
    ckpt.close()
    on_disk = sum(f.stat().st_size for f in (tmp_path / "new" / "1" / "state").rglob("*") if f.is_file())
    assert on_disk > 4 << 20, on_disk

    old = ocp.CheckpointManager(tmp_path / "old", options=ocp.CheckpointManagerOptions(create=True))
    old.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"step": 1})))
    old.wait_until_finished()
    old.close()
    compressed = sum(f.stat().st_size for f in (tmp_path / "old" / "1" / "state").rglob("*") if f.is_file())
    assert compressed < 1 << 20, compressed
    for directory in ("new", "old"):
        ckpt = Checkpointer(tmp_path / directory)
        step, restored, meta = ckpt.restore_latest(abstract_like(state))
        ckpt.close()
        assert step == 1 and meta == {"step": 1}
        for k, v in state.items():
            np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v), err_msg=f"{directory}: {k}")


# python -m jodpo.train with each save held (after Orbax started it) until the test writes a line: the second Ctrl-C
# then arrives while a save is pending, whatever the machine's speed.
# Each save is held until the test writes a line. The wait polls (0.1 s), so that the run's SIGINT handler runs
# whichever of the process's threads the kernel delivered the signal to: a read() blocked in the main thread is
# interrupted only by a signal delivered to that thread (seen once: the first Ctrl-C never handled, the test hung).
HELD_SAVES = """
import runpy, select, sys
from jodpo.program.checkpoint import Checkpointer
real = Checkpointer.save
def save(self, *args, **kwargs):
    real(self, *args, **kwargs)
    print("saving", flush=True)
    while not select.select([sys.stdin], [], [], 0.1)[0]:
        pass
    sys.stdin.readline()
Checkpointer.save = save
runpy.run_module("jodpo.train", run_name="__main__")
"""


def _read_until(stream, text: str) -> str:
    seen = ""
    for line in stream:
        seen += line
        if text in line:
            return seen
    raise AssertionError(f"the run ended before printing {text!r}: {seen[-3000:]}")


def test_a_second_ctrl_c_abandons_the_pending_save_and_exits_130(tmp_path):
    out = tmp_path / "interrupted"
    python, env = subproc.without_torch(subproc.env())
    proc = subprocess.Popen([*python, "-c", HELD_SAVES, "--config", "tiny.py", f"--config.output_dir={out}",
                             "--config.save_steps=1"], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    guard = threading.Timer(300, proc.kill)  # only a failing run gets here: its pipes close, and the test fails
    guard.start()
    try:
        _interrupt_twice(proc, out)
    finally:
        guard.cancel()


def _interrupt_twice(proc: subprocess.Popen, out: Path) -> None:
    _read_until(proc.stdout, "saving")  # step 1's save, held
    proc.send_signal(signal.SIGINT)  # the first Ctrl-C: the run will stop after its next step, saved
    err = _read_until(proc.stderr, "stopping after this step")
    proc.stdin.write("\n")
    proc.stdin.flush()  # step 1's save goes on; step 2 runs, and its save is held
    _read_until(proc.stdout, "saving")
    proc.send_signal(signal.SIGINT)  # the second, with step 2's save pending: stop at once
    err += proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT: stopping after this step, which is saved first (Ctrl-C again: stop at once, abandoning that save)" \
        in err
    assert ("jodpo.train: interrupted: stopped at once; a checkpoint being written was abandoned (the complete ones are "
            "kept): run the same command to resume from the newest") in err
    assert "Traceback" not in err and "Segmentation" not in err and "stopped by SIGINT" not in err, err[-3000:]
    assert not (out / "jodpo.lock").exists() and (out / "checkpoints" / "1").is_dir()


def test_a_stop_signal_that_arrives_inside_a_write_to_stderr_is_noted_not_fatal(tmp_path, monkeypatch):
    """The signal handler runs at any bytecode of the main thread: here inside the raw write under ``sys.stderr``'s
    buffer (as when a progress bar's write blocks on a full pipe). Writing its notice through ``sys.stderr`` from
    there raised ``RuntimeError: reentrant call`` and killed a run under load; the notice must still get out."""
    import io
    import os

    from jodpo.program.preemption import StopSignals

    log = open(tmp_path / "stderr", "wb")

    class SignalledMidWrite(io.RawIOBase):
        def writable(self):
            return True

        def fileno(self):
            return log.fileno()

        def write(self, data):
            signal.raise_signal(signal.SIGTERM)  # delivered here, with the buffer's lock held
            return os.write(log.fileno(), data)

    stream = io.TextIOWrapper(io.BufferedWriter(SignalledMidWrite()), write_through=True)
    monkeypatch.setattr("sys.stderr", stream)
    with StopSignals() as stop:
        stream.write("online dpo 60/200\n")
        stream.flush()
    log.close()
    assert stop.requested() == "SIGTERM"
    assert (tmp_path / "stderr").read_text() == ("jodpo.train: SIGTERM: stopping after this step, which is saved first\n"
                                                 "online dpo 60/200\n")

"""The run directory: one run at a time (a lock held for the run's life, a stale one taken over), and an
``output_dir`` that cannot be used refused in one line (exit 2) before anything is read or written."""
import errno
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jodpo import train
from jodpo.program import output_dir
from tests import subproc

ROOT = Path(__file__).resolve().parents[1]
# Takes the lock of argv[1], says so, and holds it until its stdin closes: a second process holding the lock for
# exactly as long as the test wants, with no timing involved.
HOLD = ("import sys; from pathlib import Path; from jodpo.program.output_dir import RunLock; "
        "lock = RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); sys.stdin.read(); lock.release()")


def _holder(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, env=subproc.env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("jodpo.train: error: ")]


def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _holder(out)
    try:
        rc = train.main(["--config", "tiny.py", f"--config.output_dir={out}"])
        errors = _errors(capsys)
        assert rc == 2 and len(errors) == 1, errors
        assert (f"output_dir '{out}' is in use by another run (pid {holder.pid} on {socket.gethostname()}"
                in errors[0]), errors
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (out / "checkpoints").exists()
    finally:
        holder.stdin.close()
    assert holder.wait() == 0
    assert not (out / output_dir.LOCK_NAME).exists()  # released by its holder
    with output_dir.RunLock(out):  # and free to take
        assert (out / output_dir.LOCK_NAME).exists()
    assert not (out / output_dir.LOCK_NAME).exists()


def test_a_lock_left_by_a_killed_run_is_taken_over_and_one_from_another_host_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = _holder(out)
    holder.kill()  # SIGKILL: nothing releases the lock
    assert holder.wait() == -signal.SIGKILL and (out / output_dir.LOCK_NAME).exists()
    lock = output_dir.RunLock(out).acquire()
    assert json.loads((out / output_dir.LOCK_NAME).read_text())["pid"] != holder.pid
    lock.release()
    (out / output_dir.LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1234, "since": "then"}))
    with pytest.raises(output_dir.RunDirError, match=r"is in use by another run \(pid 1234 on elsewhere, since then\); "
                                                 r"wait for it to end or use another output_dir \(if that process is "
                                                 "gone, delete"):
        output_dir.RunLock(out).acquire()
    (out / output_dir.LOCK_NAME).write_text('{"ho')  # torn by a kill while it was written
    with output_dir.RunLock(out):
        pass


def test_a_run_that_fails_before_its_models_load_leaves_no_directory(tmp_path, capsys):
    """An early failure (a model path that does not exist) says what it was loading, never "writing to", and
    leaves no empty output_dir (nor the parents made for it) and no lock; a directory that was there stays."""
    out = tmp_path / "runs" / "new" / "out"
    rc = train.main(["--config", "tiny.py", f"--config.output_dir={out}", "--config.model_name_or_path=/no/such"])
    said = capsys.readouterr()
    assert rc == 2 and said.err.count("jodpo.train: error: ") == 1 and "Traceback" not in said.err
    assert not (tmp_path / "runs").exists()
    assert said.out.startswith("jodpo.train: loading the policy (/no/such) and the data (") and \
        "writing to" not in said.out
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("precious")
    rc = train.main(["--config", "tiny.py", f"--config.output_dir={out}", "--config.model_name_or_path=/no/such"])
    assert rc == 2 and len(_errors(capsys)) == 1
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # the lock released, nothing else touched


def test_only_process_0_takes_the_lock(tmp_path, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert output_dir.lock_for_job(tmp_path) is None and not (tmp_path / output_dir.LOCK_NAME).exists()
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    lock = output_dir.lock_for_job(tmp_path)
    assert lock.held and (tmp_path / output_dir.LOCK_NAME).exists()
    lock.release()


OUTPUT_DIRS = {  # name: (output_dir, the phrase of the one-line message)
    "an existing file": ("{tmp}/file", "output_dir '{tmp}/file' is an existing file, not a directory; choose another"),
    "not creatable (/proc)": ("/proc/x/run", "output_dir '/proc/x/run' cannot be created (No such file or directory)"),
    "not creatable (/sys)": ("/sys/x", "output_dir '/sys/x' cannot be created (Operation not permitted)"),
    "a read-only filesystem": ("{tmp}/ro/run", "output_dir '{tmp}/ro/run' cannot be created (Read-only file system); "
                                               "choose a directory on a writable filesystem"),
    "empty": ("", "output_dir is empty: the run would write into the current directory"),
}


@pytest.mark.parametrize("case", list(OUTPUT_DIRS))
def test_an_unusable_output_dir_is_one_line(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("precious")
    monkeypatch.chdir(tmp_path)
    if case == "a read-only filesystem":  # as mkdir fails there (no such mount can be made in a test)
        mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.is_relative_to(tmp_path / "ro"):
                raise OSError(errno.EROFS, "Read-only file system")
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
    value, phrase = (s.format(tmp=tmp_path) for s in OUTPUT_DIRS[case])
    rc = train.main(["--config", "tiny.py", f"--config.output_dir={value}"])
    errors = _errors(capsys)
    assert rc == 2 and len(errors) == 1 and phrase in errors[0], errors
    assert (tmp_path / "file").read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_output_dir_expands_home_and_the_run_says_where_it_writes(tmp_path, capsys, monkeypatch):
    from jodpo.program import loop

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "_train", lambda run, out, *a: {})  # the models and data load; no step is taken
    rc = train.main(["--config", "tiny.py", "--config.output_dir=~/runs/x"])
    assert rc == 0
    assert (tmp_path / "home" / "runs" / "x").is_dir() and not (tmp_path / "~").exists()
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("jodpo.train: loading the policy (") and said[1:] == [
        f"jodpo.train: writing to {tmp_path / 'home' / 'runs' / 'x'}"]

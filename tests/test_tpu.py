"""tpu/pod.py: the exact gcloud commands each subcommand prints with --dry-run, and its refusals.

Nothing here runs gcloud: subprocess.run is replaced by a function that fails the test."""
import importlib.util
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

POD = Path(__file__).resolve().parent.parent / "tpu" / "pod.py"
spec = importlib.util.spec_from_file_location("tpu_pod", POD)
pod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pod)

WHERE = ["--name", "jodpo-v4", "--zone", "us-central2-b"]
SSH = "gcloud compute tpus tpu-vm ssh jodpo-v4 --zone=us-central2-b"


@pytest.fixture(autouse=True)
def no_side_effects(monkeypatch):
    for var in ("JODPO_TPU_NAME", "JODPO_TPU_ZONE", "JODPO_TPU_PROJECT"):
        monkeypatch.delenv(var, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a command was run: {args}")

    monkeypatch.setattr(pod, "subprocess", types.SimpleNamespace(run=refuse))


def dry(capsys, *argv) -> list[str]:
    """The printed commands of ``pod.py ARGV --dry-run``, one per line."""
    assert pod.main([*argv[:1], *WHERE, "--dry-run", *argv[1:]]) == 0
    out = capsys.readouterr().out
    return out.splitlines()


def remote(line: str) -> str:
    """The shell line that ``gcloud ... ssh --command=...`` runs on the workers."""
    [cmd] = [w for w in shlex.split(line) if w.startswith("--command=")]
    return cmd[len("--command="):]


def error(capsys, *argv) -> str:
    assert pod.main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip()


# --- the commands


def test_create_defaults_to_v4_8_and_its_runtime(capsys):
    assert dry(capsys, "create") == [
        ("gcloud compute tpus tpu-vm create jodpo-v4 --zone=us-central2-b --accelerator-type=v4-8 "
         "--version=tpu-ubuntu2204-base")]


@pytest.mark.parametrize("accel, version", [("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-8", "v2-alpha-tpuv5"),
                                            ("v6e-8", "v2-alpha-tpuv6e"), ("v4-32", "tpu-ubuntu2204-base")])
def test_create_picks_the_runtime_version_by_family(capsys, accel, version):
    [line] = dry(capsys, "create", "--accelerator-type", accel, "--spot")
    assert line == (f"gcloud compute tpus tpu-vm create jodpo-v4 --zone=us-central2-b --accelerator-type={accel} "
                    f"--version={version} --spot")


def test_create_queued_with_project_version_and_gcloud_flags(capsys):
    lines = dry(capsys, "create", "--queued", "--reserved", "--project", "my-project", "--accelerator-type",
                "v5p-8", "--version", "v2-alpha-tpuv5-custom", "--", "--network=my net", "--internal-ips")
    assert lines == [
        ("gcloud compute tpus queued-resources create jodpo-v4 --node-id=jodpo-v4 --zone=us-central2-b "
         "--project=my-project --accelerator-type=v5p-8 --runtime-version=v2-alpha-tpuv5-custom --reserved "
         "'--network=my net' --internal-ips")]


def test_status_and_delete(capsys):
    assert dry(capsys, "status") == ["gcloud compute tpus tpu-vm describe jodpo-v4 --zone=us-central2-b"]
    assert dry(capsys, "status", "--queued") == [
        "gcloud compute tpus queued-resources describe jodpo-v4 --zone=us-central2-b"]
    assert dry(capsys, "delete") == ["gcloud compute tpus tpu-vm delete jodpo-v4 --zone=us-central2-b --quiet"]
    assert dry(capsys, "delete", "--queued", "--project", "p-123456") == [
        "gcloud compute tpus queued-resources delete jodpo-v4 --zone=us-central2-b --project=p-123456 --force --quiet"]


def test_install_on_every_worker(capsys):
    [line] = dry(capsys, "install", "--repo", "https://github.com/me/jodpo.git", "--ref", "v0.1")
    assert line.startswith(f"{SSH} --worker=all '--command=")
    assert remote(line) == (
        'if [ ! -x "$HOME/.local/bin/uv" ]; then curl -LsSf https://astral.sh/uv/install.sh | sh; fi'
        " && if [ ! -d jodpo/.git ]; then git clone https://github.com/me/jodpo.git jodpo; fi"
        " && cd jodpo && git fetch --quiet origin v0.1 && git checkout --quiet --detach FETCH_HEAD"
        ' && if [ ! -x .venv/bin/python ]; then "$HOME/.local/bin/uv" venv --seed --python 3.12 .venv; fi'
        ' && "$HOME/.local/bin/uv" pip install --python .venv/bin/python -e . \'jax[tpu]\''
        " && .venv/bin/python -c 'import jax, jodpo; print(\"jodpo installed, jax\", jax.__version__)'")


def test_install_quotes_repo_and_ref(capsys):
    [line] = dry(capsys, "install", "--repo", "git@host:my repo.git", "--ref", "feat;rm", "--remote-dir", "src/jo")
    cmd = remote(line)
    assert "git clone 'git@host:my repo.git' src/jo;" in cmd
    assert "git fetch --quiet origin 'feat;rm' &&" in cmd


def test_launch_passes_arguments_through_verbatim(capsys):
    passthrough = ["--config.learning_rate=1e-6", "--config.dataset_name=my data", "--config.x=it's \"q\"",
                   "$(touch /tmp/x)"]
    [line] = dry(capsys, "launch", "--output-dir", "bucket/runs/tldr", "--env", "HF_HOME=/mnt/hf", "--",
                 *passthrough)
    assert line.startswith(f"{SSH} --worker=all '--command=cd jodpo || exit 1; ")
    cmd = remote(line)
    assert cmd == (
        'cd jodpo || exit 1; if [ -f train.pid ] && kill -0 "$(cat train.pid)" 2>/dev/null; then '
        'echo "jodpo.train is already running (pid $(cat train.pid)); run: pod.py stop" >&2; exit 1; fi; '
        + pod._shared_output_dir(types.SimpleNamespace(output_dir="bucket/runs/tldr", passthrough=passthrough)) +
        "nohup env HF_HOME=/mnt/hf .venv/bin/python -m jodpo.train --distributed --config tldr.py "
        "--config.output_dir=bucket/runs/tldr --config.learning_rate=1e-6 '--config.dataset_name=my data' "
        "'--config.x=it'\"'\"'s \"q\"' '$(touch /tmp/x)' >> train.log 2>&1 < /dev/null & echo $! > train.pid; "
        'echo "$(hostname): jodpo.train started (pid $!)"')
    # What the remote shell hands to python: exactly the arguments given after "--".
    train = cmd.split("nohup ", 1)[1].split(" >> train.log", 1)[0]
    assert shlex.split(train) == ["env", "HF_HOME=/mnt/hf", ".venv/bin/python", "-m", "jodpo.train", "--distributed",
                                  "--config", "tldr.py", "--config.output_dir=bucket/runs/tldr", *passthrough]


def test_launch_defaults(capsys):
    [line] = dry(capsys, "launch", "--config", "tldr_6.9b.py", "--log", "run 2.log")
    assert "nohup .venv/bin/python -m jodpo.train --distributed --config tldr_6.9b.py >> 'run 2.log' 2>&1 < /dev/null &" in \
        remote(line)


def test_launch_help_says_the_passthrough_distributed_and_the_default_config(capsys):
    with pytest.raises(SystemExit):
        pod.main(["launch", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for phrase in ("[-- JODPO.TRAIN ARGUMENTS ...]", "Arguments after -- go to jodpo.train verbatim",
                   "--distributed on each", "(default tldr.py)", "launch refuses an output_dir on the workers' own disks"):
        assert phrase in shown, shown


def _worker(home: Path, workers: str, *argv: str) -> subprocess.CompletedProcess:
    """The shell line ``launch`` runs on a worker, run here in ``home`` (its checkout ``home/jodpo``) with the
    metadata server answering ``workers`` for the slice's endpoints, and ``.venv/bin/python`` a stand-in that
    records its arguments."""
    [line] = _dry_lines("launch", *argv)
    stubs = home / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "curl").write_text(f"#!/bin/sh\necho '{workers}'\n")
    checkout = home / "jodpo"
    (checkout / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (checkout / ".venv" / "bin" / "python").write_text('#!/bin/sh\necho "$@" > started\n')
    for f in (stubs / "curl", checkout / ".venv" / "bin" / "python"):
        f.chmod(0o755)
    (checkout / "train.pid").unlink(missing_ok=True)
    done = subprocess.run(["bash", "-c", remote(line)], cwd=home, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home)})
    return done


def _dry_lines(*argv) -> list[str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pod.main([*argv[:1], *WHERE, "--dry-run", *argv[1:]]) == 0
    return out.getvalue().splitlines()


def test_launch_on_several_workers_refuses_an_output_dir_on_their_own_disks(tmp_path, monkeypatch):
    """On a slice of several workers each worker refuses (before starting anything) a missing output_dir or one on
    the checkout's filesystem; a single worker is not checked; a directory on another filesystem is accepted."""
    monkeypatch.setattr(pod, "subprocess", subprocess)  # the dry run only prints; the remote line runs here in bash
    two = "10.0.0.2:8470,10.0.0.3:8470"
    done = _worker(tmp_path, two, "--output-dir", "runs/tldr")
    assert done.returncode == 1 and "output_dir runs/tldr is on this worker's own disk" in done.stderr, done.stderr
    assert "pod.py mount" in done.stderr and not (tmp_path / "jodpo" / "train.pid").exists()
    done = _worker(tmp_path, two, "--", "--config.output_dir=runs/x")  # given after -- counts the same
    assert done.returncode == 1 and "output_dir runs/x is on" in done.stderr
    done = _worker(tmp_path, two)
    assert done.returncode == 1 and "needs an output_dir that they all see" in done.stderr
    done = _worker(tmp_path, "10.0.0.2:8470", "--output-dir", "runs/tldr")  # a single-host VM
    assert done.returncode == 0 and "jodpo.train started" in done.stdout, done.stderr
    other = Path("/dev/shm")
    if other.is_dir() and other.stat().st_dev != tmp_path.stat().st_dev:  # a filesystem of its own, as a mount
        done = _worker(tmp_path, two, "--output-dir", str(other / "jodpo-test-run"))
        assert done.returncode == 0 and "jodpo.train started" in done.stdout, done.stderr


def test_logs_stop_copy(capsys):
    assert dry(capsys, "logs") == [f"{SSH} --worker=0 '--command=tail -n 100 -F jodpo/train.log'"]
    assert dry(capsys, "logs", "--worker", "3", "--lines", "0") == [
        f"{SSH} --worker=3 '--command=tail -n 0 -F jodpo/train.log'"]
    [stop] = dry(capsys, "stop")
    assert stop.startswith(f"{SSH} --worker=all '--command=")
    assert remote(stop) == (
        'cd jodpo || exit 1; if [ -f train.pid ] && kill -0 "$(cat train.pid)" 2>/dev/null; then '
        'kill "$(cat train.pid)" && echo "$(hostname): stopped jodpo.train (pid $(cat train.pid))"; '
        'else echo "$(hostname): no jodpo.train running"; fi; rm -f train.pid')
    assert dry(capsys, "copy", "--output-dir", "pythia-1b-deduped-tldr-online-dpo", "--bucket",
               "gs://my-bucket/runs/tldr") == [
        (f"{SSH} --worker=0 '--command=cd jodpo && gcloud storage rsync --recursive "
         "pythia-1b-deduped-tldr-online-dpo gs://my-bucket/runs/tldr'")]
    [line] = dry(capsys, "copy", "--output-dir", "my run", "--bucket", "gs://b.example/x")
    assert remote(line) == "cd jodpo && gcloud storage rsync --recursive 'my run' gs://b.example/x"


def test_name_zone_project_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("JODPO_TPU_NAME", "env-tpu")
    monkeypatch.setenv("JODPO_TPU_ZONE", "europe-west4-a")
    monkeypatch.setenv("JODPO_TPU_PROJECT", "env-project")
    assert pod.main(["delete", "--dry-run"]) == 0
    assert capsys.readouterr().out == (
        "gcloud compute tpus tpu-vm delete env-tpu --zone=europe-west4-a --project=env-project --quiet\n")


# --- refusals: one line, exit status 2, nothing printed on stdout


@pytest.mark.parametrize("argv, message", [
    (["delete", "--zone", "us-central2-b"], "missing --name (or set JODPO_TPU_NAME)"),
    (["delete", "--name", "Bad_Name", "--zone", "us-central2-b"], "--name must be lowercase letters"),
    (["delete", "--name", "t"], "missing --zone (or set JODPO_TPU_ZONE)"),
    (["delete", *WHERE[:2], "--zone", "uscentral"], "--zone must be a zone such as us-central2-b"),
    (["create", *WHERE, "--accelerator-type", "v5e-16"], "use --accelerator-type=v5litepod-16"),
    (["create", *WHERE, "--accelerator-type", "tpu"], "--accelerator-type must look like v4-8"),
    (["create", *WHERE, "--accelerator-type", "v7x-8"], "no default runtime version for 'v7x-8': pass --version"),
    (["install", *WHERE], "install needs --repo"),
    (["launch", *WHERE, "--env", "NOEQUALS"], "--env must be KEY=VALUE"),
    (["launch", *WHERE, "--", "--config.beta=0.2", "--dry-run"], "--dry-run after -- is passed through"),
    (["logs", *WHERE, "--", "-n", "5"], "logs takes no arguments after --, got -n 5"),
    (["logs", *WHERE, "--worker", "first"], "--worker must be a worker index"),
    (["copy", *WHERE, "--bucket", "gs://b/x"], "copy needs --output-dir"),
    (["launch", *WHERE, "--output-dir", "gs://bb/run"], "output_dir is a local path; `pod.py mount"),
    (["mount", *WHERE], "mount needs --bucket"),
    (["mount", *WHERE, "--bucket", "s3://bb/x"], "--bucket must be a gs:// URL"),
    (["mount", *WHERE, "--bucket", "gs://bbb", "--mount-point", "../x"], "--mount-point must be a directory"),
    (["copy", *WHERE, "--output-dir", "out"], "copy needs --bucket"),
    (["copy", *WHERE, "--output-dir", "out", "--bucket", "my-bucket/x"], "--bucket must be a gs:// URL"),
    (["copy", *WHERE, "--output-dir", "out", "--bucket", "s3://bucket/x"], "--bucket must be a gs:// URL"),
    (["copy", *WHERE, "--output-dir", "gs://b/run", "--bucket", "gs://bb/x"], "is already in a bucket"),
])
def test_refusals(capsys, argv, message):
    err = error(capsys, *argv)
    assert err.startswith(f"pod.py {argv[0]}: error: ") and message in err and "\n" not in err


def test_spot_and_reserved_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        pod.main(["create", *WHERE, "--spot", "--reserved", "--dry-run"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_refuses_to_run_without_gcloud(capsys, monkeypatch):
    monkeypatch.setattr(pod.shutil, "which", lambda name: None)
    err = error(capsys, "delete", *WHERE)
    assert "gcloud not found on PATH" in err and "--dry-run" in err


def test_the_script_runs_as_a_program():
    ok = subprocess.run([sys.executable, str(POD), "delete", *WHERE, "--dry-run"], capture_output=True, text=True,
                        check=False)
    assert (ok.returncode, ok.stdout) == (0,
                                          "gcloud compute tpus tpu-vm delete jodpo-v4 --zone=us-central2-b --quiet\n")
    bad = subprocess.run([sys.executable, str(POD), "copy", *WHERE, "--output-dir", "o", "--bucket", "x"],
                         capture_output=True, text=True, check=False)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.startswith("pod.py copy: error: --bucket must be a gs:// URL")


def test_mount(capsys):
    [line] = dry(capsys, "mount", "--bucket", "gs://my-bucket/runs", "--mount-point", "gcs")
    assert line.startswith(f"{SSH} --worker=all '--command=command -v gcsfuse >/dev/null || {{ ")
    assert "sudo apt-get install -y -qq gcsfuse; } && mkdir -p gcs && " in line
    assert "(mountpoint -q gcs || gcsfuse --implicit-dirs --only-dir runs my-bucket gcs)" in line

#!/usr/bin/env python3
"""Create a Cloud TPU VM or pod slice, install jodpo on every worker, train, follow, copy, delete (gcloud).

    python tpu/pod.py create  --name NAME --zone ZONE --accelerator-type v4-8 [--spot | --reserved] [--queued]
    python tpu/pod.py status  --name NAME --zone ZONE [--queued]
    python tpu/pod.py install --name NAME --zone ZONE --repo GIT_URL [--ref main]
    python tpu/pod.py mount   --name NAME --zone ZONE --bucket gs://BUCKET [--mount-point bucket]
    python tpu/pod.py launch  --name NAME --zone ZONE [--config tldr.py] [--output-dir DIR] [-- --config.F=V ...]
    python tpu/pod.py logs    --name NAME --zone ZONE [--worker 0]
    python tpu/pod.py stop    --name NAME --zone ZONE
    python tpu/pod.py copy    --name NAME --zone ZONE --output-dir DIR --bucket gs://BUCKET/PATH
    python tpu/pod.py delete  --name NAME --zone ZONE [--queued]

Each subcommand prints every command it runs, shell-quoted, one per line (on stderr, after "+ "); with
``--dry-run`` it prints them on stdout and runs nothing, so ``... --dry-run | sh`` does the same thing.
Arguments after ``--`` pass through verbatim: to ``jodpo.train`` (launch) or to ``gcloud`` (create).
``--name``, ``--zone`` and ``--project`` default to $JODPO_TPU_NAME, $JODPO_TPU_ZONE, $JODPO_TPU_PROJECT.
Standard library only: it runs wherever gcloud does, without jax or jodpo installed. See docs/tpu.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys

# Runtime (software) versions for JAX, by the accelerator type's family (the part before the last "-").
RUNTIME_VERSIONS = {
    "v2": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
UV_INSTALLER = "https://astral.sh/uv/install.sh"
UV = '"$HOME/.local/bin/uv"'  # where the uv installer puts it; quoted so that the remote shell expands $HOME
PID_FILE = "train.pid"


class UsageError(Exception):
    """A bad or missing option: one line for the user, exit status 2."""


# --------------------------------------------------------------------------------------------------
# The commands, one builder per subcommand: each returns the argv lists to run, in order.
# --------------------------------------------------------------------------------------------------


def _where(a) -> list[str]:
    """The flags that place every gcloud call."""
    return [f"--zone={a.zone}"] + ([f"--project={a.project}"] if a.project else [])


def _ssh(a, worker: str, remote: str) -> list[str]:
    """``remote`` (one line of shell) on ``worker`` ("all" or an index) of the TPU VM, through gcloud."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", a.name, *_where(a), f"--worker={worker}",
            f"--command={remote}"]


def create(a) -> list[list[str]]:
    family = _family(a.accelerator_type)
    version = a.version or RUNTIME_VERSIONS.get(family)
    if version is None:
        raise UsageError(f"no default runtime version for {a.accelerator_type!r}: pass --version "
                         f"(known families: {', '.join(RUNTIME_VERSIONS)})")
    capacity = ["--spot"] if a.spot else ["--reserved"] if a.reserved else []
    if a.queued:  # the queued resource and its node share the name, so later commands need only --name
        cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", a.name, f"--node-id={a.name}", *_where(a),
               f"--accelerator-type={a.accelerator_type}", f"--runtime-version={version}"]
    else:
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", "create", a.name, *_where(a),
               f"--accelerator-type={a.accelerator_type}", f"--version={version}"]
    return [cmd + capacity + a.passthrough]


def status(a) -> list[list[str]]:
    kind = ["queued-resources"] if a.queued else ["tpu-vm"]
    return [["gcloud", "compute", "tpus", *kind, "describe", a.name, *_where(a)]]


def install(a) -> list[list[str]]:
    """Clone (or update) jodpo at ``--ref`` on every worker, make a venv with uv's Python, install jodpo and
    jax[tpu]. The TPU images' own Python is 3.10 and jodpo needs 3.11+, hence uv. Safe to run again."""
    d, q = shlex.quote(a.remote_dir), shlex.quote
    steps = [
        f"if [ ! -x {UV} ]; then curl -LsSf {UV_INSTALLER} | sh; fi",
        f"if [ ! -d {d}/.git ]; then git clone {q(a.repo)} {d}; fi",
        f"cd {d}",
        f"git fetch --quiet origin {q(a.ref)}",  # a branch, a tag or a commit
        "git checkout --quiet --detach FETCH_HEAD",
        f"if [ ! -x .venv/bin/python ]; then {UV} venv --seed --python {q(a.python)} .venv; fi",
        f"{UV} pip install --python .venv/bin/python -e . {q(a.jax)}",
        ".venv/bin/python -c 'import jax, jodpo; print(\"jodpo installed, jax\", jax.__version__)'",
    ]
    return [_ssh(a, "all", " && ".join(steps))]


# The slice's workers, as jax.distributed reads them on a Cloud TPU VM: a comma between each two
WORKERS_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints")


def _shared_output_dir(a) -> str:
    """The remote shell's check, on a slice of several workers, that the run's output_dir (``--output-dir``, or
    ``--config.output_dir=`` after ``--``) is given and on another filesystem than the checkout (a mounted bucket,
    NFS): every worker writes its own shards of each checkpoint, so on each worker's own disk every checkpoint would
    be in pieces. A single-host VM (one worker) is not checked."""
    given = [w.split("=", 1)[1] for w in a.passthrough if w.startswith("--config.output_dir=")]
    out = shlex.quote(given[-1] if given else a.output_dir or "")
    fix = ("mount a bucket on every worker (pod.py mount) and give --output-dir under it (../bucket/RUN), or a "
           "directory on NFS")
    return (f"workers=$(curl -sf -m 10 -H Metadata-Flavor:Google {WORKERS_URL} 2>/dev/null); "
            f'case "$workers" in *,*) out={out}; '
            'if [ -z "$out" ]; then echo "$(hostname): a slice of several workers needs an output_dir that they all '
            f'see: {fix}" >&2; exit 1; fi; '
            'd="$out"; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; '
            'if [ "$(stat -c %d "$d")" = "$(stat -c %d .)" ]; then echo "$(hostname): output_dir $out is on this '
            "worker's own disk, and every worker of the slice writes its own part of each checkpoint: "
            f'{fix}" >&2; exit 1; fi;; esac; ')


def launch(a) -> list[list[str]]:
    """``python -m jodpo.train --distributed`` in the background on every worker (``jax.distributed`` finds
    the other workers of the slice by itself). Refuses to start a second run next to a live one, and on a slice of
    several workers one whose output_dir is on each worker's own disk (``_shared_output_dir``)."""
    d, q = shlex.quote(a.remote_dir), shlex.quote
    env = ["env", *a.env] if a.env else []
    train = [*env, ".venv/bin/python", "-m", "jodpo.train", "--distributed", "--config", a.config]
    if a.output_dir:
        train.append(f"--config.output_dir={a.output_dir}")
    train += a.passthrough
    remote = (f"cd {d} || exit 1; "
              f'if [ -f {PID_FILE} ] && kill -0 "$(cat {PID_FILE})" 2>/dev/null; then '
              f'echo "jodpo.train is already running (pid $(cat {PID_FILE})); run: pod.py stop" >&2; exit 1; fi; '
              f"{_shared_output_dir(a)}"
              f"nohup {' '.join(q(w) for w in train)} >> {q(a.log)} 2>&1 < /dev/null & "
              f"echo $! > {PID_FILE}; "
              'echo "$(hostname): jodpo.train started (pid $!)"')
    return [_ssh(a, "all", remote)]


def logs(a) -> list[list[str]]:
    return [_ssh(a, a.worker, f"tail -n {a.lines} -F {shlex.quote(a.remote_dir)}/{shlex.quote(a.log)}")]


def stop(a) -> list[list[str]]:
    remote = (f"cd {shlex.quote(a.remote_dir)} || exit 1; "
              f'if [ -f {PID_FILE} ] && kill -0 "$(cat {PID_FILE})" 2>/dev/null; then '
              f'kill "$(cat {PID_FILE})" && echo "$(hostname): stopped jodpo.train (pid $(cat {PID_FILE}))"; '
              f'else echo "$(hostname): no jodpo.train running"; fi; rm -f {PID_FILE}')
    return [_ssh(a, "all", remote)]


GCSFUSE_INSTALL = (
    "command -v gcsfuse >/dev/null || { "
    'echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt '
    'gcsfuse-$(lsb_release -c -s) main" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null && '
    "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc "
    ">/dev/null && sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse; }")


def mount(a) -> list[list[str]]:
    """The bucket at ``~/MOUNT_POINT`` on every worker (Cloud Storage FUSE): one directory that all processes
    of a pod see at the same path, for ``output_dir`` (every process writes its shards of each checkpoint)."""
    bucket, _, prefix = a.bucket[len("gs://"):].partition("/")
    mp = shlex.quote(a.mount_point)
    only = f" --only-dir {shlex.quote(prefix)}" if prefix else ""
    remote = (f"{GCSFUSE_INSTALL} && mkdir -p {mp} && "
              f"(mountpoint -q {mp} || gcsfuse --implicit-dirs{only} {shlex.quote(bucket)} {mp}) && "
              f'echo "$(hostname): gs://{bucket}/{prefix} at ~/{a.mount_point}"')
    return [_ssh(a, "all", remote)]


def copy(a) -> list[list[str]]:
    """Worker 0's ``output_dir`` to the bucket. rsync, not cp: the same ``DIR`` lands at the same place every
    time, and a second copy transfers only new files (new checkpoints)."""
    remote = (f"cd {shlex.quote(a.remote_dir)} && "
              f"gcloud storage rsync --recursive {shlex.quote(a.output_dir)} {shlex.quote(a.bucket)}")
    return [_ssh(a, "0", remote)]


def delete(a) -> list[list[str]]:
    if a.queued:  # --force: delete the TPU node along with the queued resource
        return [["gcloud", "compute", "tpus", "queued-resources", "delete", a.name, *_where(a), "--force", "--quiet"]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "delete", a.name, *_where(a), "--quiet"]]


COMMANDS = {"create": create, "status": status, "install": install, "mount": mount, "launch": launch, "logs": logs,
            "stop": stop, "copy": copy, "delete": delete}
PASSTHROUGH = {"create": "gcloud", "launch": "jodpo.train"}  # who gets the arguments after "--"


# --------------------------------------------------------------------------------------------------
# Options and their checks
# --------------------------------------------------------------------------------------------------


def _family(accelerator_type: str) -> str:
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if not m:
        raise UsageError(f"--accelerator-type must look like v4-8, v5litepod-16 or v5p-8, got {accelerator_type!r}")
    if m.group(1) == "v5e":
        raise UsageError(f"gcloud names v5e 'v5litepod': use --accelerator-type=v5litepod-{m.group(2)}")
    return m.group(1)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=os.environ.get("JODPO_TPU_NAME"),
                        help="the TPU VM (and queued resource) name [$JODPO_TPU_NAME]")
    common.add_argument("--zone", default=os.environ.get("JODPO_TPU_ZONE"), help="e.g. us-central2-b [$JODPO_TPU_ZONE]")
    common.add_argument("--project", default=os.environ.get("JODPO_TPU_PROJECT"),
                        help="GCP project (default: gcloud's) [$JODPO_TPU_PROJECT]")
    common.add_argument("--dry-run", action="store_true", help="print the commands, one per line, and run nothing")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--remote-dir", default="jodpo", help="jodpo's checkout on the workers, relative to $HOME")
    log = argparse.ArgumentParser(add_help=False)
    log.add_argument("--log", default="train.log", help="the training log, relative to --remote-dir")
    queued = argparse.ArgumentParser(add_help=False)
    queued.add_argument("--queued", action="store_true", help="the TPU was created as a queued resource")

    p = argparse.ArgumentParser(prog="pod.py", description=__doc__.split("\n")[0],
                                epilog="See docs/tpu.md.", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("create", parents=[common, queued], help="create the TPU VM or pod slice")
    c.add_argument("--accelerator-type", default="v4-8", help="v4-8, v5litepod-16, v5p-8, ... (default v4-8)")
    c.add_argument("--version", help="runtime version (default by family: " +
                   ", ".join(f"{k} {v}" for k, v in RUNTIME_VERSIONS.items()) + ")")
    cap = c.add_mutually_exclusive_group()
    cap.add_argument("--spot", action="store_true", help="Spot capacity (preemptible, cheaper)")
    cap.add_argument("--reserved", action="store_true", help="the project's reserved capacity")

    sub.add_parser("status", parents=[common, queued], help="describe the TPU VM or queued resource")

    i = sub.add_parser("install", parents=[common, remote], help="clone jodpo and install it on every worker")
    i.add_argument("--repo", help="git URL of jodpo that the workers can clone (required)")
    i.add_argument("--ref", default="main", help="branch, tag or commit (default main)")
    i.add_argument("--python", default="3.12", help="Python version for the venv, fetched by uv (default 3.12)")
    i.add_argument("--jax", default="jax[tpu]", help="the pip requirement for JAX (default jax[tpu])")

    m = sub.add_parser("mount", parents=[common], help="mount a gs:// bucket at the same path on every worker")
    m.add_argument("--bucket", help="gs://BUCKET[/PATH] to mount (required)")
    m.add_argument("--mount-point", default="bucket", help="where, relative to $HOME (default bucket)")

    la = sub.add_parser(
        "launch", parents=[common, remote, log], help="start jodpo.train on every worker",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="pod.py launch [options] [-- JODPO.TRAIN ARGUMENTS ...]",
        description="Start `.venv/bin/python -m jodpo.train --distributed --config CONFIG` in the background on\n"
                    "every worker of the slice (--distributed on each: jax.distributed finds the other workers by\n"
                    "itself), its output appended to --log, its pid in train.pid.",
        epilog="Arguments after -- go to jodpo.train verbatim, each quoted for the remote shell:\n"
               "  pod.py launch --config tldr.py -- --config.learning_rate=1e-6 --config.save_total_limit=3\n"
               "On a slice of several workers (v4-16, v5litepod-16 and up) each writes its own part of every\n"
               "checkpoint, so output_dir must be one directory they all see: `pod.py mount` a bucket, then\n"
               "--output-dir ../bucket/RUN. launch refuses an output_dir on the workers' own disks there.\n"
               "See docs/tpu.md.")
    la.add_argument("--config", default="tldr.py", help="config file or name in configs/ (default tldr.py)")
    la.add_argument("--output-dir", help="sets --config.output_dir (default: the config's; on a slice of several "
                                         "workers: under a `mount`ed bucket)")
    la.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable for the run (repeatable), e.g. XLA_FLAGS=...")

    lo = sub.add_parser("logs", parents=[common, remote, log], help="follow the training log of one worker")
    lo.add_argument("--worker", default="0", help="worker index, or all (default 0)")
    lo.add_argument("--lines", type=int, default=100, help="lines of history shown first (default 100)")

    sub.add_parser("stop", parents=[common, remote], help="stop jodpo.train on every worker")

    co = sub.add_parser("copy", parents=[common, remote], help="copy worker 0's output_dir to a gs:// bucket")
    co.add_argument("--output-dir", help="the run's output_dir on the worker, relative to --remote-dir (required)")
    co.add_argument("--bucket", help="destination, gs://BUCKET[/PATH] (required)")

    sub.add_parser("delete", parents=[common, queued], help="delete the TPU VM (or queued resource and its VM)")
    return p


def check(a) -> None:
    """Every option a command uses, with one clear message for the first one that is wrong."""
    if not a.name:
        raise UsageError("missing --name (or set JODPO_TPU_NAME)")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", a.name):
        raise UsageError("--name must be lowercase letters, digits and hyphens, starting with a letter, "
                         f"got {a.name!r}")
    if not a.zone:
        raise UsageError("missing --zone (or set JODPO_TPU_ZONE), e.g. --zone=us-central2-b")
    if not re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z]", a.zone):
        raise UsageError(f"--zone must be a zone such as us-central2-b, got {a.zone!r}")
    if a.project is not None and not re.fullmatch(r"[a-z][-a-z0-9.:]{4,62}", a.project):
        raise UsageError(f"--project must be a GCP project id, got {a.project!r}")
    if a.passthrough and a.command not in PASSTHROUGH:
        raise UsageError(f"{a.command} takes no arguments after --, got {shlex.join(a.passthrough)}")
    if a.command == "create":
        _family(a.accelerator_type)
    if a.command == "install":
        if not a.repo:
            raise UsageError("install needs --repo, the git URL of jodpo that the workers can clone")
        if not a.ref or a.ref.startswith("-"):
            raise UsageError(f"--ref must be a branch, tag or commit, got {a.ref!r}")
    remote_dir = getattr(a, "remote_dir", None)
    if remote_dir is not None and (remote_dir in ("", ".", "/") or remote_dir.startswith("-")):
        raise UsageError(f"--remote-dir must name a directory for jodpo's checkout, got {a.remote_dir!r}")
    if a.command == "launch":
        if not a.config:
            raise UsageError("--config must name a config file")
        if a.output_dir and a.output_dir.startswith("gs://"):
            raise UsageError(f"--output-dir {a.output_dir}: output_dir is a local path; `pod.py mount --bucket "
                             "gs://...` the bucket on every worker and give the path under the mount point")
        for kv in a.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", kv):
                raise UsageError(f"--env must be KEY=VALUE, got {kv!r}")
    if a.command == "logs":
        if a.worker != "all" and not a.worker.isdigit():
            raise UsageError(f"--worker must be a worker index (0, 1, ...) or all, got {a.worker!r}")
        if a.lines < 0:
            raise UsageError(f"--lines must be >= 0, got {a.lines}")
    if a.command == "copy":
        if not a.output_dir:
            raise UsageError("copy needs --output-dir: the run's output_dir on the worker, e.g. "
                             "pythia-1b-deduped-tldr-online-dpo for tldr.py")
        if a.output_dir.startswith("gs://"):
            raise UsageError(f"--output-dir {a.output_dir} is already in a bucket: nothing to copy")
    if a.command in ("copy", "mount"):
        if not a.bucket:
            raise UsageError(f"{a.command} needs --bucket, e.g. --bucket=gs://my-bucket/runs/tldr")
        if not re.fullmatch(r"gs://[a-z0-9][-a-z0-9._]{1,220}[a-z0-9](/\S*)?", a.bucket):
            raise UsageError(f"--bucket must be a gs:// URL such as gs://my-bucket/runs/tldr, got {a.bucket!r}")
    if a.command == "mount" and (not a.mount_point or a.mount_point.startswith(("-", "/")) or ".." in a.mount_point):
        raise UsageError(f"--mount-point must be a directory name under $HOME, got {a.mount_point!r}")


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def run(cmd: list[str], dry_run: bool) -> int:
    """Print ``cmd`` shell-quoted; unless ``dry_run``, run it (no shell: the printed line is what runs)."""
    line = shlex.join(cmd)
    if dry_run:
        print(line, flush=True)
        return 0
    print(f"+ {line}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after the first "--" belongs to the program underneath, untouched by argparse.
    ours, passthrough = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = parser().parse_args(ours)
    a.passthrough = passthrough
    try:
        if "--dry-run" in passthrough:  # it would go to gcloud or jodpo.train, and the commands would run
            raise UsageError("--dry-run after -- is passed through, not ours: put it before --")
        check(a)
        commands = COMMANDS[a.command](a)
        if not a.dry_run and shutil.which(commands[0][0]) is None:
            raise UsageError(f"{commands[0][0]} not found on PATH: install the Google Cloud CLI "
                             "(https://cloud.google.com/sdk/docs/install), or use --dry-run to see the commands")
    except UsageError as e:
        print(f"pod.py {a.command}: error: {e}", file=sys.stderr)
        return 2
    for cmd in commands:
        try:
            rc = run(cmd, a.dry_run)
        except KeyboardInterrupt:  # e.g. leaving `logs`
            return 130
        if rc != 0:
            print(f"pod.py {a.command}: failed (exit status {rc}): {shlex.join(cmd)}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())

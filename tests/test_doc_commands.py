"""The shell commands of README.md and docs/: every ``bash`` block runs here as written, or is marked
``<!-- illustrative: why -->`` on the line above it (it needs the Hub, gcloud, an accelerator, or more than three
minutes on a CPU); and every command runs from the clone (``bash scripts/env.sh python ...``; ``python tpu/pod.py``,
which needs nothing installed, aside).

The blocks that run are the tiny run's: ``jodpo.evaluate``, ``jodpo.generate`` and the export, each block in a
directory of its own laid out as after the README's first command (``runs/tiny``: the session's tiny_run, copied;
``~/.cache/jodpo``: the session's cache, where that command built the tiny world). Each command runs in this process
through its program's ``main`` (the commands' own compiled programs are shared with test_evaluate and
test_generate), its words as the shell would give them (``~`` expanded, ``VAR=value`` set for it). With stderr not
a terminal, as here, no progress bar is redrawn in place (a log file would keep every redraw)."""
import importlib
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- illustrative: (?P<why>.*?) -->\n)?```bash\n(?P<body>.*?)^```$", re.M | re.S)
ENV = "bash scripts/env.sh "


def blocks() -> list[tuple[str, str | None, str]]:
    """``(where, why, body)`` of every bash block: ``file:line``, the illustrative mark's reason (None: unmarked)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text[:m.start("body")].count("\n")
            out.append((f"{path.relative_to(ROOT)}:{line}", m["why"], m["body"]))
    return out


def commands(body: str) -> list[str]:
    """A block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in (re.sub(r"(^|\s)#.*$", "", raw).strip() for raw in joined.splitlines()) if line]


def test_every_block_runs_here_or_says_why_not_and_runs_from_the_clone():
    found = blocks()
    assert len(found) >= 20, "the docs' bash blocks are not found"
    for where, why, body in found:
        assert why is None or len(why.split()) >= 3, f"{where}: say why the block is illustrative"
        for command in commands(body):
            for m in re.finditer(r"(?<![\w/.=-])python3?(?= )", command):
                from_clone = command[:m.start()].endswith(ENV) or command[m.end():].startswith(" tpu/pod.py")
                assert from_clone, f"{where}: {command!r} runs a bare python; from the clone: {ENV}python ..."
        if why is None:
            for command in commands(body):
                assert ENV in command and _program(shlex.split(command.split(ENV, 1)[1])), \
                    f"{where}: {command!r} is not run here: mark the block <!-- illustrative: why -->"


def _program(words: list[str]):
    """The ``main`` of ``python -m jodpo.X`` or ``python scripts/export_hf.py`` (None for anything else)."""
    if words[:2] == ["python", "-m"] and words[2].startswith("jodpo."):
        return importlib.import_module(words[2]).main
    if words[:2] == ["python", "scripts/export_hf.py"]:
        return helpers.export_hf.main
    return None


def _run(command: str, monkeypatch) -> None:
    before, after = command.split(ENV, 1)
    for assignment in shlex.split(before):  # VAR=value before the command (JODPO_EXTRAS: what env.sh installs)
        name, value = assignment.split("=", 1)
        monkeypatch.setenv(name, value)
    words = [os.path.expanduser(w) if w.startswith("~") else w for w in shlex.split(after)]
    assert _program(words)(words[3:] if words[1] == "-m" else words[2:]) == 0, command


RUN = [(where, body) for where, why, body in blocks() if why is None]


@pytest.mark.parametrize("where, body", RUN, ids=[where for where, _ in RUN])
def test_the_block_runs_as_written(where, body, tiny_run, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "jodpo").symlink_to(os.environ["JODPO_CACHE"])  # where tiny_run's world was built
    monkeypatch.setenv("HOME", str(home))
    clone = tmp_path / "clone"
    shutil.copytree(tiny_run, clone / "runs" / "tiny")  # the README's first run (a block may write into it)
    (clone / "scripts").symlink_to(ROOT / "scripts")
    monkeypatch.chdir(clone)
    for command in commands(body):
        _run(command, monkeypatch)
    # stderr is no terminal here (a log file's case): the progress bars are lines of their own, none redrawn in place
    err = capsys.readouterr().err
    assert "\r" not in err, err[-2000:]

"""What a user has after installing jodpo alone: the runtime dependencies run a chat-format dataset (chat templates
need jinja2, which transformers leaves optional) with relative paths taken from the caller's directory, a TRL-style
command line and a YAML recipe; and the wheel that ``pip install .`` builds holds the bundled configs."""
import json
import subprocess
import sys
import zipfile

import pytest

from tests import hf_fixtures, subproc


def test_runtime_only_chat_run_from_the_callers_directory(checkpoints, tmp_path):
    """From a directory of the user's own, without torch: a YAML recipe, a chat dataset, a reward module and the
    output all given relative to it, fields as TRL's flags; everything lands there, nothing in the checkout."""
    (tmp_path / "my_rewards.py").write_text(
        "def concise(prompts, completions, completion_ids, **kw):\n"
        "    assert isinstance(completions[0], list)  # chat data: the completion as the assistant's message\n"
        "    return [-len(ids) / 8.0 for ids in completion_ids]\n")
    hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    (tmp_path / "recipe.yaml").write_text(
        f"model_name_or_path: {checkpoints['qwen2']['causal_lm']}\n"
        "dataset_name: data/train.jsonl\neval_dataset: data/test.jsonl\ndataset_test_split: train\n"
        "reward_funcs: [my_rewards:concise]\nper_device_train_batch_size: 2\nmax_new_tokens: 4\nmax_length: 96\n"
        "max_prompt_length: 64\nprompt_buckets: [64]\nmax_eval_prompts: 2\nper_device_eval_batch_size: 2\nreport_to: none\n"
        "eval_strategy: steps\n")
    before = sorted(p.name for p in subproc.ROOT.iterdir())
    python, env = subproc.without_torch(subproc.env())
    cmd = [*python, "-m", "jodpo.train", "--config", "recipe.yaml", "--output_dir", "runs/mine", "--max_steps", "2",
           "--logging_steps", "1", "--bf16", "false", "--no_gradient_checkpointing"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = subproc.metrics_lines(tmp_path / "runs" / "mine")
    assert [m["step"] for m in lines if "loss" in m] == [1, 2] and "eval/objective/scores" in lines[-1]
    assert all(m["objective/scores"] <= 0 for m in lines if "loss" in m)  # the user's reward, from their module
    saved = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    assert saved["dataset_name"] == "data/train.jsonl" and saved["bf16"] is False
    assert sorted(p.name for p in subproc.ROOT.iterdir()) == before


def test_a_missing_local_dataset_is_named_as_a_file_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    from jodpo.program import data as D

    monkeypatch.chdir(tmp_path)
    with pytest.raises(D.DataError, match=r"'data/train.jsonl': no such file or directory \(looked at "):
        D.load_rows("data/train.jsonl")


def test_the_wheel_holds_the_package_its_configs_and_its_dependencies(tmp_path):
    """``pip install .`` installs this wheel: every module of jodpo, the bundled recipes (found by name from anywhere),
    and the runtime dependencies, jinja2 included."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(subproc.ROOT)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("jodpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {str(p.relative_to(subproc.ROOT)) for p in (subproc.ROOT / "jodpo").rglob("*.py")}
    assert package <= names, sorted(package - names)
    assert "jodpo/configs/tiny.py" in names and not any(n.startswith(("tests/", ".venv/")) for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: jinja2" in meta and "Requires-Dist: pyyaml" in meta


@pytest.mark.parametrize("extras", ["torch", "torch,plot", "test"])
def test_the_torch_extra_installs_the_cpu_build_of_torch_first(tmp_path, extras):
    """``JODPO_EXTRAS=torch`` (a script that builds transformers model objects) installs torch==2.13.0 before jodpo
    and its extra, as the test extra does, so that pip never resolves torch to the CUDA wheels. The environment's
    python is a stand-in that records what it is asked to install."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    stub.chmod(0o755)
    env = dict(subproc.env(), JODPO_VENV=str(venv), JODPO_EXTRAS=extras, PYTHON=sys.executable)
    env.pop("JODPO_NO_INSTALL", None)
    done = subprocess.run(["bash", str(subproc.ROOT / "scripts" / "env.sh"), "true"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    installs = [line for line in log.read_text().splitlines() if " install " in f" {line} "]
    assert installs[1].endswith("torch==2.13.0") and installs[2].endswith(f"-e {subproc.ROOT}[{extras}]"), installs


def test_two_commands_started_at_once_install_the_environment_once(tmp_path):
    """The two processes of a local multi-process job start ``scripts/env.sh`` together on an environment not
    installed yet: one installs while the other waits on the lock, then finds it installed, and both run. Without the
    lock both pips wrote into the same environment at once (issue 63: ``No such file or directory: ...INSTALLER...tmp``).
    The environment's python is a stand-in that takes half a second an install and records when each begins and ends."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "begin $*" >> {log}\nsleep 0.5\necho "end $*" >> {log}\n')
    stub.chmod(0o755)
    env = dict(subproc.env(), JODPO_VENV=str(venv), PYTHON=sys.executable)
    env.pop("JODPO_NO_INSTALL", None)
    env.pop("JODPO_EXTRAS", None)
    procs = [subprocess.Popen(["bash", str(subproc.ROOT / "scripts" / "env.sh"), "true"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["begin", "end"] * 2  # one call at a time
    assert sum(c.startswith("begin") and c.endswith(f"-e {subproc.ROOT}") for c in calls) == 1  # installed once

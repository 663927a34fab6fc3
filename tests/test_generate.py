"""python -m jodpo.generate: a run's completions to JSONL; an interrupted run continues to the same file; the same
completions from a run directory and from its export, and on one device or two; errors are one line with exit
status 2."""
import importlib.util
import json
import subprocess

import pytest

from jodpo import generate as G
from jodpo.tasks import toy
from tests import subproc

ROOT = subproc.ROOT
_spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
export_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_hf)

class Killed(RuntimeError):
    pass


ARGS = ["--max_prompts", "20"]  # batches of 8, 8 and 4 (the last filled up to 8)


@pytest.fixture(scope="module")
def generated(tiny_run, tmp_path_factory):
    """The tiny run's completions of its first 20 evaluation prompts, uninterrupted."""
    out = tmp_path_factory.mktemp("generate") / "full.jsonl"
    assert G.main([str(tiny_run), "--out", str(out), *ARGS]) == 0
    return out


def test_rows_hold_the_prompt_the_completion_and_its_length(generated):
    rows = [json.loads(line) for line in generated.read_text().splitlines()]
    prompts = [json.loads(line)["prompt"] for line in (toy.world_dir() / "eval.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(20)) and [r["prompt"] for r in rows] == prompts[:20]
    assert all(r["prompt_text"] == r["prompt"] for r in rows)  # text prompts render as themselves
    for r in rows:  # the trained policy writes positive words; a completion without EOS fills max_new_tokens (12)
        words = r["completion"].split()
        assert words and all(w in toy.vocabulary() for w in words)
        assert r["completion_tokens"] == (len(words) + 1 if r["eos"] else 12)
    assert sum(toy.sentiment_reward(None, [r["completion"] for r in rows])) / 20 > 0.5
    settings = json.loads(G.settings_path(generated).read_text())
    assert settings["step"] == 200 and settings["temperature"] == 1.0 and settings["max_new_tokens"] == 12


def test_an_interrupted_run_continues_to_the_same_file(tiny_run, generated, tmp_path, monkeypatch, capsys):
    out = tmp_path / "resumed.jsonl"
    calls, kill_at = [], {8}
    real = G.completion_rows

    def interrupted(policy, data, start, stop):
        calls.append(start)
        if start in kill_at:
            raise Killed  # killed while sampling the second batch
        return real(policy, data, start, stop)

    monkeypatch.setattr(G, "completion_rows", interrupted)
    with pytest.raises(Killed):
        G.main([str(tiny_run), "--out", str(out), *ARGS])
    full = generated.read_text().splitlines(keepends=True)
    assert out.read_text() == "".join(full[:8])
    # as if killed while writing the second batch: half of it there, and a torn line
    out.write_text("".join(full[:12]) + full[12][:20])
    calls.clear()
    kill_at.clear()
    assert G.main([str(tiny_run), "--out", str(out), *ARGS]) == 0
    assert calls == [8, 16]  # the half-written batch is drawn again, the first is not
    assert out.read_bytes() == generated.read_bytes()
    calls.clear()
    assert G.main([str(tiny_run), "--out", str(out), *ARGS]) == 0 and calls == []  # finished: nothing to do
    capsys.readouterr()
    assert G.main([str(tiny_run), "--out", str(out), *ARGS, "--temperature", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jodpo.generate: error: ") and "temperature: 1.0 -> 0.0" in err and "\n" not in err
    assert out.read_bytes() == generated.read_bytes()  # refused: nothing touched


def test_a_run_directory_and_its_export_generate_the_same(tiny_run, generated, tmp_path):
    exported, _ = export_hf.export(str(tiny_run), str(tmp_path / "hf"))
    out = tmp_path / "exported.jsonl"
    eval_set = toy.world_dir() / "eval.jsonl"
    # an exported model has no run config: the run's settings are given by their training names
    assert G.main([str(exported), "--out", str(out), *ARGS, "--dataset_name", str(eval_set), "--seed", "0",
                   "--max_new_tokens", "12", "--max_prompt_length", "16", "--temperature", "1.0",
                   "--bf16", "False"]) == 0
    assert out.read_text() == generated.read_text()


def test_two_devices_split_the_batch_and_generate_the_same(tiny_run, generated, tmp_path):
    out = tmp_path / "two.jsonl"  # batches of 4 prompts per device x 2 devices: the same 8 rows a batch
    python, env = subproc.without_torch(subproc.cpu_env(2))
    p = subprocess.run([*python, "-m", "jodpo.generate", str(tiny_run), "--out", str(out), *ARGS,
                        "--per_device_eval_batch_size", "4"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in generated.read_text().splitlines()]
    mean, ended = sum(r["completion_tokens"] for r in rows) / 20, sum(r["eos"] for r in rows)
    evaluation = toy.world_dir() / "eval.jsonl"  # the run's evaluation set, said
    assert p.stdout.splitlines() == [
        f"jodpo.generate: prompts: {evaluation} (all its rows: a single file has no splits, so the 'train' split is the "
        "whole file), the first 20", f"20 completions in {out} (mean {mean:.1f} tokens, {ended} of 20 ended with EOS)"]
    assert out.read_text() == generated.read_text()


def test_bad_input_is_one_line_and_exit_status_2(tiny_run, tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    cases = [(["--step", "7"], f"{tiny_run} has no checkpoint of step 7; it has steps [100, 200]"),
             (["--top_p", "2"], "top_p must be in (0, 1], got 2.0"),
             (["--dataset_name", str(tmp_path / "none.jsonl")], "none.jsonl': no such file or directory"),
             (["--config.temperature=0.5", "--config.beta=1"], "this command does not take 'beta'"),
             (["--temprature", "1"], "unknown argument '--temprature'. Did you mean '--temperature'?"),
             (["--max_prompts", "0"], "--max_prompts must be >= 1, got 0")]
    model = str(toy.world_dir() / "model")
    for extra, message in cases:
        capsys.readouterr()
        assert G.main([str(tiny_run), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("jodpo.generate: error: ") and message in err and "\n" not in err, err
    assert not out.exists()
    # the run's training prompts (a single file: its test split is the file) are refused unless asked for
    trained_on = toy.world_dir() / "prompts.jsonl"
    assert G.main([str(tiny_run), "--out", str(out), "--dataset_name", str(trained_on)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"jodpo.generate: error: the prompts would be {trained_on} (all its rows: a single file has no "
                   f"splits, so the 'train' split is the whole file), which {tiny_run} trained on (it is the training "
                   "data, read whole); give held-out prompts (--dataset_name, or --dataset_test_split of a dataset with "
                   "such a split), or --allow_training_prompts to use its training prompts anyway"), err
    assert G.main([str(tiny_run), "--out", str(out), "--dataset_name", str(trained_on), "--allow_training_prompts",
                   "--max_prompts", "8"]) == 0
    assert capsys.readouterr().out.startswith(
        f"jodpo.generate: prompts: {trained_on} (all its rows: a single file has no splits, so the 'train' split is the "
        "whole file), the first 8 (the run's training prompts: --allow_training_prompts)\n")
    out.unlink()
    G.settings_path(out).unlink()
    cases = [(["--step", "3"], f"--step 3: {model} is not a training output_dir (no checkpoints/), so it has no steps"),
             ([], "no prompts: give --dataset_name")]
    for extra, message in cases:
        capsys.readouterr()
        assert G.main([model, "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("jodpo.generate: error: ") and message in err and "\n" not in err, err
    assert not out.exists()


def test_a_file_it_did_not_write_is_refused_and_left_alone(tiny_run, generated, tmp_path, capsys):
    lines = generated.read_text().splitlines(keepends=True)
    settings = G.settings_path(generated).read_text()
    other = json.loads(lines[3]) | {"prompt": "review the other day :"}
    files = {"foreign.jsonl": ("".join(lines), None, "exists and was not written by this command (no "
                                                     "foreign.settings.json beside it)"),
             "other.jsonl": ("".join(lines[:3]) + json.dumps(other) + "\n", settings,
                             "row 3 is not prompt 3 of the dataset; the file belongs to other prompts"),
             "garbage.jsonl": ("".join(lines[:3]) + "not json\n", settings, "is not a JSONL file this command wrote")}
    for name, (text, beside, message) in files.items():
        out = tmp_path / name
        out.write_text(text)
        if beside is not None:
            G.settings_path(out).write_text(beside)
        capsys.readouterr()
        assert G.main([str(tiny_run), "--out", str(out), *ARGS]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("jodpo.generate: error: ") and message in err and "\n" not in err, err
        assert out.read_text() == text


def test_stop_token_period_ends_completions_at_the_first_period_as_in_training(checkpoints):
    path = str(checkpoints["llama"]["causal_lm"])
    plain = G.load_policy(path, overrides={"bf16": False})
    policy = G.load_policy(path, overrides={"bf16": False, "stop_token": "period"})
    period = policy.tokenizer.encode(".", add_special_tokens=False)
    assert len(period) == 1 and period[0] not in plain.sampling.eos_token_ids
    assert policy.sampling.eos_token_ids == (*plain.sampling.eos_token_ids, period[0])


def test_which_prompts_are_a_runs_training_prompts(tmp_path):
    """A run's training prompts are its dataset's training split, or the whole of a single file (or of a mixture of
    files) it trained on: a file has no other split."""
    from jodpo.program.sources import describe_split, training_prompts

    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "test.jsonl", "other.jsonl"):
        (tmp_path / "data" / name).write_text('{"prompt": "p"}\n')
    d, f = str(tmp_path / "data"), str(tmp_path / "data" / "train.jsonl")
    run = {"dataset_name": d, "dataset_mixer": None, "dataset_train_split": "train"}
    assert training_prompts(None, d, "test", run) is None
    assert training_prompts(None, d, "train", run) == "'train' is also the training split (dataset_train_split)"
    assert training_prompts(None, "org/name", "train", run) is None
    assert describe_split(None, d, "test") == f"the 'test' split of {d}"
    on_file = run | {"dataset_name": f}
    assert training_prompts(None, f, "test", on_file) == "it is the training data, read whole"
    assert training_prompts(None, str(tmp_path / "data" / "other.jsonl"), "test", on_file) is None
    mixed = {"dataset_name": "", "dataset_mixer": {f: 1.0}, "dataset_train_split": "train"}
    assert training_prompts({f: 1.0}, "", "test", mixed) == "its files are the training data, read whole"
    assert training_prompts({f: 0.5}, "", "test", mixed) is None and training_prompts(None, f, "test", mixed) is None
    hub = {"dataset_name": "org/name", "dataset_mixer": None, "dataset_train_split": "train"}
    assert training_prompts(None, "org/name", "train", hub) and not training_prompts(None, "org/name", "test", hub)

"""Bad input to ``python -m jodpo.train``: one line naming the problem and the fix, exit status 2, no
traceback, nothing in the output directory destroyed. Every message is listed in docs/troubleshooting.md."""
import errno
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jodpo.parallel import sharding as S
from jodpo import train
from jodpo.program import aborts
from jodpo.models.families import SUPPORTED
from jodpo.program import loop
from jodpo.program.checkpoint import Checkpointer
from tests import hf_fixtures, subproc

DOC_FILE = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
DOC = DOC_FILE.read_text() if DOC_FILE.exists() else ""


@pytest.fixture(scope="module")
def world(checkpoints, tmp_path_factory):
    """A config file for a tiny online DPO run, and bad variants of its inputs."""
    root = tmp_path_factory.mktemp("errors")
    data = hf_fixtures.prompt_dataset(root / "data")
    cfg = root / "cfg.py"
    cfg.write_text(
        "from jodpo.program.config import TrainConfig\n"
        "def get_config():\n"
        f"    return TrainConfig(model_name_or_path={str(checkpoints['neox']['causal_lm'])!r},\n"
        f"        reward_model_path={str(checkpoints['neox']['reward'])!r}, dataset_name={str(data)!r},\n"
        "        max_steps=2, per_device_train_batch_size=2, max_new_tokens=4, max_length=96, max_prompt_length=64,\n"
        "        bf16=False, logging_steps=1)\n")
    bad = root / "bad"
    bad.mkdir()
    # an architecture jodpo does not implement
    shutil.copytree(checkpoints["neox"]["causal_lm"], bad / "bert")
    conf = json.loads((bad / "bert" / "config.json").read_text())
    conf.update(model_type="bert", architectures=["BertForMaskedLM"])
    (bad / "bert" / "config.json").write_text(json.dumps(conf))
    # a classifier with two labels
    shutil.copytree(checkpoints["neox"]["reward"], bad / "two_labels")
    conf = json.loads((bad / "two_labels" / "config.json").read_text())
    conf.update(num_labels=2, id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1})
    (bad / "two_labels" / "config.json").write_text(json.dumps(conf))
    # a checkpoint whose config.json maps AutoModelForCausalLM to code of its own (transformers' trust_remote_code)
    shutil.copytree(checkpoints["neox"]["causal_lm"], bad / "remote")
    conf = json.loads((bad / "remote" / "config.json").read_text())
    conf["auto_map"] = {"AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}
    (bad / "remote" / "config.json").write_text(json.dumps(conf))
    # a truncated weights file
    shutil.copytree(checkpoints["neox"]["causal_lm"], bad / "truncated")
    weights = bad / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    # a reward model sharing the tokenizer, with fewer embedding rows than the policy can sample
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = hf_fixtures.build_tokenizer(bad / "tok")
    small = hf_fixtures.family_configs(tok.pad_token_id, tok.eos_token_id)["neox"]
    small.vocab_size, small.num_labels = hf_fixtures.VOCAB - 16, 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(small).save_pretrained(bad / "small_vocab_rm")
    tok.save_pretrained(bad / "small_vocab_rm")
    # data
    (bad / "no_prompt.jsonl").write_text('{"text": "hello"}\n' * 4)
    (bad / "empty.jsonl").write_text("")
    (bad / "images.jsonl").write_text('{"prompt": "Describe the image.", "images": ["cat.png"]}\n' * 4)
    (bad / "malformed.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b}\n' + '{"prompt": "c"}\n' * 4)
    (bad / "no_messages.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n{"prompt": []}\n' * 4)
    hf_fixtures.prompt_dataset(bad / "chat", chat=True)
    # a policy whose tokenizer has no chat template (a base model's)
    shutil.copytree(checkpoints["neox"]["causal_lm"], bad / "no_template")
    (bad / "no_template" / "chat_template.jinja").unlink()
    shutil.copytree(checkpoints["neox"]["reward"], bad / "rm_no_template")
    (bad / "rm_no_template" / "chat_template.jinja").unlink()
    return root, cfg, bad


def reward_server_down(prompts, completions, **kwargs):
    raise ConnectionError("my reward server is down")


def reward_words(prompts, completions, **kwargs):
    return ["good"] * len(completions)


SIGNAL = {"calls": 0, "scored": 1}  # reward_then_none's calls so far, and how many of them give rewards


def reward_then_none(prompts, completions, **kwargs):
    """Rewards for the first ``SIGNAL["scored"]`` calls, then None for every completion (a function reading a column
    that only some rows have, say)."""
    SIGNAL["calls"] += 1
    return [float(len(c)) for c in completions] if SIGNAL["calls"] <= SIGNAL["scored"] else [None] * len(completions)


CASES = {  # name: (argv after --config CFG, the phrase the one-line message must contain)
    "missing config file": (None, "config file 'no_such_config.py' not found"),
    "unknown field": (["--config.lerning_rate=1e-6"], "unknown field 'lerning_rate'. Did you mean 'learning_rate'?"),
    "wrong type": (["--config.max_steps=many"], "field 'max_steps' wants int, got 'many'"),
    "non-positive beta": (["--config.beta=0"], "beta must be > 0"),
    "non-positive learning rate": (["--config.learning_rate=-1e-6"], "learning_rate must be > 0"),
    "unknown loss type": (["--config.loss_type=dpo"], "unknown loss_type 'dpo'; choose one of"),
    "missing model path": (["--config.model_name_or_path=/no/such/model"], "not a model directory (no such directory)"),
    "hub offline": (["--config.model_name_or_path=EleutherAI/pythia-70m"],
                    "not in the local Hugging Face cache and HF_HUB_OFFLINE is set. Download it on a machine with "
                    "network (hf download EleutherAI/pythia-70m)"),
    "unsupported architecture": (["--config.model_name_or_path={bad}/bert"], "architecture ['BertForMaskedLM'] is not "
                                                                             f"supported; jodpo supports {SUPPORTED}."),
    "a checkpoint with code of its own": (["--config.model_name_or_path={bad}/remote"],
                                          "contains custom code (AutoModelForCausalLM: modeling_remote."
                                          "RemoteForCausalLM), which transformers runs only with "
                                          "trust_remote_code=True"),
    "a dataset with images": (["--config.dataset_name={bad}/images.jsonl"],
                              "the dataset has an 'images' column: jodpo trains a vision-language checkpoint's "
                              "language model on text prompts"),
    "reward model is a causal LM": (["--config.reward_model_path={policy}"], "not a sequence classifier"),
    "reward model with two labels": (["--config.reward_model_path={bad}/two_labels"], "sequence classifier with 2 "
                                                                                      "labels; a reward model needs "
                                                                                      "num_labels=1"),
    "vocabulary mismatch": (["--config.reward_model_path={bad}/small_vocab_rm"], "the reward model's embedding has only"),
    "judge and a reward model": (["--config.judge={policy}"], "judge and reward_model_path are both set"),
    "judge that cannot be imported": (["--config.reward_model_path=None", "--config.judge=no_such_module:judge"],
                                      "judge 'no_such_module:judge' cannot be imported"),
    "judge answers not one token each": (["--config.reward_model_path=None", "--config.judge={policy}",
                                          "--config.judge_answer_tokens=['zero','one']"],
                                         "tokens for the judge's tokenizer; give answers that are one token each"),
    "LoRA target not in the model": (["--config.use_peft=True", "--config.lora_target_modules=['q_proj']"],
                                     "lora_target_modules ['q_proj'] are not modules of this gpt_neox model"),
    "corrupt safetensors": (["--config.model_name_or_path={bad}/truncated"], "corrupt or truncated safetensors file"),
    "missing dataset": (["--config.dataset_name=/no/such/data.jsonl"], "dataset '/no/such/data.jsonl': no such file or directory (looked at "),
    "no prompt column": (["--config.dataset_name={bad}/no_prompt.jsonl"], "the dataset has no 'prompt' column"),
    "a malformed JSON line": (["--config.dataset_name={bad}/malformed.jsonl"],
                              "{bad}/malformed.jsonl, line 2: not valid JSON (Unterminated string starting at column "
                              "12); each line of a JSON Lines file is one JSON object: fix or delete that line"),
    "a chat prompt with no messages": (["--config.dataset_name={bad}/no_messages.jsonl"],
                                       "row 2 of the dataset (counting from 1): the prompt is an empty list of "
                                       "messages; give every chat prompt at least one message, or drop the row"),
    "chat prompts and no chat template": (["--config.dataset_name={bad}/chat", "--config.model_name_or_path="
                                           "{bad}/no_template"], "no_template) has no chat template (a base model's "
                                                                 "often has none); give one with chat_template_path"),
    "chat prompts and a reward model without a chat template": (["--config.dataset_name={bad}/chat",
                                                                 "--config.reward_model_path={bad}/rm_no_template"],
                                                                "reward_model_path: {bad}/rm_no_template's tokenizer "
                                                                "has no chat template, and the prompts are chat "
                                                                "messages"),
    "empty dataset": (["--config.dataset_name={bad}/empty.jsonl"], "is empty"),
    "prompts all too long": (["--config.max_prompt_length=2"], "are longer than max_prompt_length=2 tokens"),
    "reward model path that does not exist": (["--config.reward_model_path=/no/such/rm"],
                                              "reward_model_path: /no/such/rm: not a model directory (no such "
                                              "directory). Pass a directory holding a *ForSequenceClassification"),
    "reward model path that is not a model": (["--config.reward_model_path={bad}"],
                                              "reward_model_path: {bad}: no config.json"),
    "judge path that does not exist": (["--config.reward_model_path=None", "--config.judge=/no/such/judge"],
                                       "judge: /no/such/judge: not a model directory"),
    "reward function that raises": (["--config.reward_model_path=None",
                                     "--config.reward_funcs=['tests.test_errors:reward_server_down']"],
                                    "reward function tests.test_errors:reward_server_down raised ConnectionError: my "
                                    "reward server is down (at step 1: batch 0 of epoch 0); fix the function"),
    "reward function that returns strings": (["--config.reward_model_path=None",
                                              "--config.reward_funcs=['tests.test_errors:reward_words']"],
                                             "reward function tests.test_errors:reward_words returned 'good' (str) for "
                                             "completion 0; it must return a number or None per completion (at step 1"),
    "greedy online training": (["--config.temperature=0"], "temperature=0 decodes greedily, so both completions of a "
                                                           "prompt are the same"),
    "mesh does not fit the devices": (["--config.mesh_data=2", "--config.mesh_fsdp=1"],
                                      "mesh (data=2, fsdp=1, expert=1, tensor=1) needs 2 devices, there are 1"),
    "sampler takes every device": (["--config.sampler_devices=1"],
                                   "sampler_devices=1 leaves none of the 1 devices to train on"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line_and_destroys_nothing(world, checkpoints, tmp_path, capsys, monkeypatch, case):
    root, cfg, bad = world
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    extra, phrase = CASES[case]
    argv = ["--config", "no_such_config.py"] if extra is None else ["--config", str(cfg)] + [
        a.format(bad=bad, policy=checkpoints["neox"]["causal_lm"]) for a in extra]
    phrase = phrase.format(bad=bad)
    rc = train.main(argv + [f"--config.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("jodpo.train: error: ")]
    assert rc == 2 and len(errors) == 1 and phrase in errors[0], err
    assert "Traceback" not in "\n".join(err)
    if case in ("a malformed JSON line", "a chat prompt with no messages"):  # and nothing else said about it
        assert err == errors, err
    assert (out / "keep.txt").read_text() == "precious"
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())  # nothing saved


def test_troubleshooting_lists_every_message():
    for case, (_, phrase) in CASES.items():
        phrase = phrase.format(bad="DIR")
        assert case in DOC and phrase in DOC, f"docs/troubleshooting.md does not list: {case}: {phrase}"
    for phrase in ("no space left on device while saving", "stopped by SIGTERM at step", "updates in a row had a "
                   "non-finite", "has non-finite values (NaN or Inf); it was not saved", "tokenizer has no pad token",
                   "max_new_tokens", "is not empty", "is in use by another run (pid", "is an existing file, not a "
                   "directory", "cannot be created (", "is not writable (", "output_dir is empty: the run would write",
                   "jodpo.train: writing to", "fix the file", "compilation cache off: a multi-process job on CPUs",
                   "completions got no reward (every reward returned None or NaN)",
                   "prompts are empty; they train on completions of nothing",
                   "stopping after this step, which is saved first", "interrupted: stopped at once; a checkpoint being "
                   "written was abandoned", "holds a run whose state does not fit the configured model",
                   "the checkpoint was trained on other data (the same 16 rows, different content: fingerprint"):
        assert phrase in DOC, phrase


def test_batch_not_divisible_by_the_data_parallel_size():
    class FakeMesh:
        shape = {"data": 2, "fsdp": 2, "tensor": 1}

    run = loop.Run.__new__(loop.Run)
    object.__setattr__(run, "mesh", FakeMesh())  # a frozen Run with only its mesh
    with pytest.raises(S.MeshError, match="a batch of 6 rows cannot be split over the 4 data-parallel devices"):
        run.put(np.zeros((1, 6, 3), np.int32))


@pytest.fixture(scope="module")
def finished(world, tmp_path_factory):
    """The world's run to its end (2 steps), a checkpoint at each step: copied by the tests that resume it."""
    _, cfg, _ = world
    out = tmp_path_factory.mktemp("finished") / "out"
    assert train.main(["--config", str(cfg), f"--config.output_dir={out}", "--config.save_steps=1"]) == 0
    return out


def _resume(finished, tmp_path, world, *extra):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out, train.main(["--config", str(world[1]), f"--config.output_dir={out}", "--config.save_steps=1", *extra])


def test_a_checkpoint_of_another_model_is_refused_and_kept(world, finished, checkpoints, tmp_path, capsys):
    out, rc = _resume(finished, tmp_path, world, "--allow_config_change",
                      f"--config.model_name_or_path={checkpoints['llama']['causal_lm']}")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jodpo.train: error: ")]
    assert rc == 2 and len(errors) == 1, errors
    assert f"{out}/checkpoints/2 holds a run whose state does not fit the configured model (params/" in errors[0]
    assert (f"resume with the config it was trained with ({out}/config.json), or use a new output_dir for this model"
            in errors[0])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1", "2"]  # nothing set aside as unreadable
    for f in ("config.json", "source_model/config.json", "metrics.jsonl"):
        assert (out / f).read_text() == (finished / f).read_text(), f


def test_a_resume_with_another_model_config_rewrites_source_model(world, finished, checkpoints, tmp_path):
    policy = tmp_path / "policy"  # the same shapes, another config.json
    shutil.copytree(checkpoints["neox"]["causal_lm"], policy)
    conf = json.loads((policy / "config.json").read_text())
    conf["layer_norm_eps"] = 1e-3
    (policy / "config.json").write_text(json.dumps(conf))
    out, rc = _resume(finished, tmp_path, world, "--allow_config_change", f"--config.model_name_or_path={policy}")
    assert rc == 0
    assert json.loads((out / "source_model" / "config.json").read_text())["layer_norm_eps"] == 1e-3  # not stale
    assert not list(out.glob("source_model.*"))


def test_a_resume_on_other_data_with_as_many_rows_is_refused(world, finished, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(json.loads((finished / "config.json").read_text())["dataset_name"], data)
    rows = (data / "train.jsonl").read_text().replace("r/test", "r/other")
    (data / "train.jsonl").write_text(rows)
    out, rc = _resume(finished, tmp_path, world, "--allow_config_change", f"--config.dataset_name={data}")
    err = capsys.readouterr().err
    assert rc == 2 and f"jodpo.train: error: {out}: the checkpoint was trained on other data (the same 16 rows, " \
        "different content: fingerprint " in err, err[-2000:]
    assert "resume with the data it was trained on, or use a new output_dir" in err


def test_disk_full_while_saving_keeps_the_previous_checkpoints(world, finished, tmp_path, capsys, monkeypatch):
    root, cfg, _ = world
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    real = Checkpointer.save

    def full(self, step, state, meta, only_model=False):  # as Orbax fails on a full disk, inside the save
        with self._disk_errors(step):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Checkpointer, "save", full)
    rc = train.main(["--config", str(cfg), f"--config.output_dir={out}", "--config.save_steps=1",
                     "--config.max_steps=3", "--allow_config_change"])
    err = capsys.readouterr().err
    assert rc == 1 and "jodpo.train: error: no space left on device while saving checkpoint 3" in err, err
    assert "Traceback" not in err
    monkeypatch.setattr(Checkpointer, "save", real)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept


def _aborting_run(tmp_path, native_words: str = ""):
    """``python -m jodpo.train`` on a recipe that writes ``native_words`` to descriptor 2 (as XLA's and gloo's C++
    does, past Python's ``sys.stderr``), then aborts the process from a thread, as XLA does."""
    recipe = tmp_path / "aborts.py"
    recipe.write_text("import os, sys, threading\n"
                      "def get_config():\n"
                      "    print('python words', file=sys.stderr, flush=True)\n"
                      f"    os.write(2, {native_words.encode()!r})\n"
                      "    threading.Thread(target=os.abort).start()\n"
                      "    threading.Event().wait()\n")
    python, environ = subproc.without_torch(subproc.env())
    done = subprocess.run([*python, "-m", "jodpo.train", "--config", str(recipe)], env=environ, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == -signal.SIGABRT, done.stderr[-3000:]
    assert "python words" in done.stderr and native_words in done.stderr  # both reach stderr
    assert "Fatal Python error" not in done.stderr  # faulthandler's report went to the watcher only
    return done.stderr.splitlines()[-1]


def test_an_abort_is_followed_by_one_line_that_says_the_run_resumes(tmp_path):
    """A process that XLA aborts (SIGABRT from one of its threads) runs no more Python; the command's watcher prints,
    after the native log, what happened and that the same command resumes."""
    assert _aborting_run(tmp_path) == train.FATAL_SIGNAL.format(signal="Aborted", cause=aborts.UNKNOWN)
    assert "the process was ended by a fatal signal" in DOC


@pytest.mark.parametrize("words, names", [
    ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
     "gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 16384 vs 1. Received data size doesn't match "
     "expected size. Is there a distributed collective mismatch in your code?\n", "received a message of another"),
    ("F1127 external/xla/xla/backends/cpu/collectives/in_process_communicator.cc:190] Termination timeout for `all "
     "gather RendezvousKey{run_id=RunId: 7, global_devices=[0, 1], op_id=53}` of 40 seconds exceeded\n",
     "waited past its limit for a collective")])
def test_the_line_after_an_abort_names_what_the_native_log_says(tmp_path, words, names):
    """Issue 63: a gloo size mismatch is not a rendezvous timeout; the line says which it was, from the native log's
    last words (gloo's C++ exception, XLA's fatal log), and still that the checkpoints are intact."""
    line = _aborting_run(tmp_path, words)
    assert line.startswith("jodpo.train: the process was ended by a fatal signal (Aborted): ") and names in line, line
    assert line.endswith("The checkpoints already saved are intact: run the same command to resume from the newest "
                         "(docs/troubleshooting.md)")


def test_a_run_that_ends_well_leaves_no_line_and_no_watcher(tmp_path):
    code = ("from jodpo.program import aborts\n"
            "aborts.explain_fatal_signals('never printed ({signal})')\n"
            "aborts.explain_fatal_signals('installed once only')\n"
            "raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], env=subproc.env(), capture_output=True, text=True, timeout=60)
    # capture_output waits for every holder of stderr: the watcher ended with the process
    assert done.returncode == 3 and done.stderr == "", done.stderr


@pytest.fixture(scope="module")
def unscored(world, tmp_path_factory):
    """A run with save_only_model whose rewards stop at its second step: ``(out, rc, stderr, argv)``."""
    _, cfg, _ = world
    out = tmp_path_factory.mktemp("unscored") / "out"
    argv = ["--config", str(cfg), f"--config.output_dir={out}", "--config.reward_model_path=None",
            "--config.reward_funcs=['tests.test_errors:reward_then_none']", "--config.save_only_model=True",
            "--config.save_steps=10", "--config.report_to=none"]
    SIGNAL.update(calls=0, scored=1)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = train.main(argv)
    return out, rc, err.getvalue(), argv


def test_a_step_without_any_reward_stops_the_run_saved(unscored):
    """No finite reward for any completion of a step: one line, exit 2, and the steps done so far saved (before,
    a warning, then the run trained to its end on ties at 0 and exited 0)."""
    out, rc, err, _ = unscored
    errors = [line for line in err.splitlines() if line.startswith("jodpo.train: error: ")]
    assert rc == 2 and errors == [
        "jodpo.train: error: every reward returned None or NaN for all 4 completions of the step: no signal to train "
        f"on (the run stops rather than train on ties at 0) (at step 2: batch 1 of epoch 0); saved {out}/checkpoints/1; "
        "fix the function, then run the same command to resume"], err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]


def test_a_model_only_checkpoint_resumes_with_a_new_optimizer(unscored, tmp_path, capsys):
    """save_only_model (transformers' field): the checkpoint holds the parameters, not AdamW's moments, and a resume
    from it says that the optimizer restarts; the start says what the checkpoints cost and that step 2 compiles."""
    from jodpo.program.checkpoint import Checkpointer

    done, _, _, argv = unscored
    out = tmp_path / "out"
    shutil.copytree(done, out)
    SIGNAL.update(calls=0, scored=10)
    rc = train.main([*argv[:2], f"--config.output_dir={out}", *argv[3:]])
    said = capsys.readouterr().out
    assert rc == 0, said
    assert f"resumed from {out}/checkpoints/1, which holds the model only (save_only_model): the optimizer restarts " \
           "(AdamW's moments from zero; the learning-rate schedule goes on from where the run is)" in said
    assert "step 2 compiles the step's programs first (XLA: a minute or more on a CPU, the first time); later starts " \
           "of this config read them from the compilation cache (" in said
    assert "B each, the parameters only (save_only_model); 1 to save, every one kept (save_total_limit=None)" in said
    ckpt = Checkpointer(out / "checkpoints")
    assert ckpt.steps() == [1, 2] and not ckpt.has_optimizer(2)
    ckpt.close()

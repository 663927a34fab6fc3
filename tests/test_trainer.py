"""TRL's Python API: TRL's documented online-DPO example, with only its import changed, runs on jodpo (tiny local
stand-ins for its model, tokenizer and dataset, a Python reward function) and logs what the command line logs for
the same config, in the same process; a TRL script that pushes to the Hub (a local stand-in of its API) and saves
and evaluates by transformers' strategies runs too."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jodpo
from jodpo import train
from jodpo.errors import ConfigError, Stopped
from tests import hf_fixtures, hub_stand_in, subproc
from tests.subproc import WALL_CLOCK

# TRL's example (docs: Online DPO Trainer, "Quick start" with a reward), with `trl.experimental.online_dpo` -> `jodpo`
EXAMPLE = """
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from jodpo import OnlineDPOConfig, OnlineDPOTrainer

model = AutoModelForCausalLM.from_pretrained(MODEL)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
train_dataset = Dataset.from_list(ROWS)  # load_dataset("trl-lib/ultrafeedback-prompt", split="train") in TRL's

training_args = OnlineDPOConfig(output_dir=OUT, **TINY)
trainer = OnlineDPOTrainer(
    model=model, reward_funcs=reward_len, args=training_args, processing_class=tokenizer, train_dataset=train_dataset
)
trainer.train()
"""

TINY = dict(max_steps=2, per_device_train_batch_size=2, max_new_tokens=4, max_length=96, max_prompt_length=64,
            prompt_buckets=[64], logging_steps=1, bf16=False, report_to="none", seed=3)


def test_trls_example_with_its_import_changed_logs_what_the_command_line_logs(checkpoints, tmp_path, monkeypatch,
                                                                             capsys):
    (tmp_path / "my_reward.py").write_text("def reward_len(completions, **kwargs):\n"
                                           "    return [-abs(8 - len(c)) / 8 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_reward import reward_len

    data = hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    model = str(checkpoints["qwen2"]["causal_lm"])
    scope = dict(MODEL=model, ROWS=rows, OUT=str(tmp_path / "api"), TINY=TINY, reward_len=reward_len)
    exec(compile(textwrap.dedent(EXAMPLE), "trl_example.py", "exec"), scope)
    assert scope["trainer"].args.reward_funcs == ("my_reward:reward_len",)

    cli = ["--model_name_or_path", model, "--dataset_name", str(data / "train.jsonl"), "--reward_funcs",
           "my_reward:reward_len", "--output_dir", str(tmp_path / "cli"), "--prompt_buckets", "64",
           *[f"--config.{k}={v!r}" for k, v in TINY.items() if k != "prompt_buckets"], "--push_to_hub",
           "--hub_strategy", "end", "--torch_compile"]  # the command pushes when training ends, as TRL's scripts do
    hub = hub_stand_in.HubStandIn()
    hub_stand_in.patch(hub, monkeypatch)
    try:
        assert train.main(cli) == 0  # a second run in the same process
    finally:
        hub.close()
    api, command = subproc.metrics_lines(tmp_path / "api"), subproc.metrics_lines(tmp_path / "cli")
    assert [m["step"] for m in api] == [1, 2] and api == command
    assert [c["summary"] for c in hub.commits] == ["End of training"] and "config.json" in hub.files(
        "stand-in-user/cli")
    said = capsys.readouterr().out
    assert "jodpo.train: torch_compile=True has no effect in jodpo: XLA compiles every program" in said

    out = scope["trainer"].save_model(str(tmp_path / "saved"))
    reread, _ = jodpo.load_model(str(out))
    assert reread.vocab_size == jodpo.load_model(model)[0].vocab_size


def test_trls_example_with_paths_in_place_of_objects_needs_no_torch(checkpoints, tmp_path):
    """The README's alternative to JODPO_EXTRAS=torch: the model and reward model given as paths (hub ids alike), no
    tokenizers, in an environment without torch, read as the command line reads them (the run is built: models,
    data, rewards, its first state's layout; the steps themselves are the command line's, tested elsewhere)."""
    import subprocess

    data = hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    script = textwrap.dedent(f"""
        import sys
        from datasets import load_dataset
        from jodpo import OnlineDPOConfig, OnlineDPOTrainer
        from jodpo.program.run import build

        train_dataset = load_dataset("json", data_files={str(data / "train.jsonl")!r}, split="train")
        trainer = OnlineDPOTrainer(model={str(checkpoints["qwen2"]["causal_lm"])!r},
                                   reward_funcs={str(checkpoints["qwen2"]["reward"])!r},
                                   args=OnlineDPOConfig(output_dir={str(tmp_path / "out")!r}, **{TINY!r}),
                                   train_dataset=train_dataset)
        run = build(trainer.args, trainer.given)
        assert run.rewards.model is not None and len(run.train) == 16 and "torch" not in sys.modules
        print("built")
    """)
    python, env = subproc.without_torch(subproc.env())
    done = subprocess.run([*python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "built", done.stderr[-3000:]


def test_a_script_gets_the_commands_set_up_and_its_second_start_reads_the_compilation_cache(checkpoints, tmp_path):
    """Issue 59: ``OnlineDPOTrainer(...).train()`` sets XLA up as ``python -m jodpo.train`` does (the compilation
    cache, determinism, CPU threads): the script, run twice with another output_dir, compiles the step the first
    time and reads it from the cache the second (it said "the compilation cache is off" and compiled every time)."""
    import subprocess

    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    script = textwrap.dedent(f"""
        import sys
        from datasets import load_dataset
        from jodpo import OnlineDPOConfig, OnlineDPOTrainer

        args = OnlineDPOConfig(output_dir=sys.argv[1], **{TINY!r})
        OnlineDPOTrainer(model={str(checkpoints["qwen2"]["causal_lm"])!r},
                         reward_funcs={str(checkpoints["qwen2"]["reward"])!r}, args=args,
                         train_dataset=load_dataset("json", data_files={str(data / "train.jsonl")!r},
                                                    split="train")).train()
        """)
    environ = subproc.env(JODPO_CACHE=str(tmp_path), JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    del environ["JAX_COMPILATION_CACHE_DIR"]  # the suite's: a script's user has none, compilation_cache_dir="auto"
    python, env = subproc.without_torch(environ)
    runs = [subprocess.run([*python, "-c", script, str(tmp_path / name)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300) for name in ("first", "again")]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-3000:]
    assert f"read them from the compilation cache ({tmp_path / 'xla'})" in runs[0].stdout + runs[0].stderr
    assert "Persistent compilation cache hit for 'jit_online_step'" not in runs[0].stderr
    assert "Persistent compilation cache hit for 'jit_online_step'" in runs[1].stderr


def test_trls_arguments_jodpo_has_no_use_for_are_refused_in_one_line(checkpoints):
    with pytest.raises(ConfigError, match="unknown field.*Did you mean 'learning_rate'"):
        jodpo.OnlineDPOConfig(output_dir="x", learnin_rate=1e-6)
    assert jodpo.OnlineDPOConfig("x", beta=[0.2]).beta == 0.2  # TRL's one-element list, a float as in TRL
    with pytest.raises(ConfigError, match="ref_model is a tuple but not jodpo's"):
        jodpo.OnlineDPOTrainer("m", ref_model=("m", "p"))
    with pytest.raises(ConfigError, match="optimizers is a torch Trainer's"):
        jodpo.OnlineDPOTrainer("m", optimizers=(object(), None))
    trainer = jodpo.OnlineDPOTrainer(str(checkpoints["qwen2"]["causal_lm"]),
                                     peft_config={"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                  "target_modules": ["q_proj", "v_proj"]})
    args = trainer.args
    assert (args.use_peft, args.lora_r, args.lora_alpha, args.lora_target_modules) == (True, 4, 8, ("q_proj", "v_proj"))


class Recorder:
    """A transformers TrainerCallback as a script writes one: records the events, and can end the run at a step."""

    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("on_train_begin", state.global_step, state.max_steps))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("on_step_end", state.global_step, state.epoch))
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("on_log", state.global_step, "loss" in logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("on_evaluate", state.global_step, sorted(metrics)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("on_save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("on_train_end", state.global_step, len(state.log_history)))


def test_objects_peft_eval_sets_and_callbacks_through_train(checkpoints, tmp_path):
    """jodpo's (model, params), a reward-model object, a peft LoraConfig and a dict of eval sets through train() log
    what the same run from paths logs; callbacks get TRL's events with transformers' state, and one that stops the run
    leaves a checkpoint the next train() (in the same process) resumes exactly."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    assert issubclass(Recorder, object) and TrainerCallback  # transformers' own class is importable here
    policy, reward = (str(checkpoints["qwen2"][k]) for k in ("causal_lm", "reward"))
    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    rows = {s: Dataset.from_json(str(data / f"{s}.jsonl")) for s in ("train", "test")}
    evals = {"short": rows["test"].select(range(2)), "long": rows["test"].select(range(2, 6))}
    tiny = TINY | dict(max_eval_prompts=4, per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2)

    recorder = Recorder()
    objects = jodpo.OnlineDPOTrainer(
        model=jodpo.load_model(policy), reward_funcs=AutoModelForSequenceClassification.from_pretrained(reward),
        args=jodpo.OnlineDPOConfig(output_dir=str(tmp_path / "objects"), **tiny), train_dataset=rows["train"],
        eval_dataset=evals, processing_class=AutoTokenizer.from_pretrained(policy),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), callbacks=[recorder])
    output = objects.train()
    lines = subproc.metrics_lines(tmp_path / "objects")
    assert set(lines[-1]) == {"step", "eval_short/objective/scores", "eval_short/win_rate",
                              "eval_long/objective/scores", "eval_long/win_rate"}  # transformers' eval_<name>_ prefix
    assert recorder.events == [
        ("on_train_begin", 0, 2), ("on_step_end", 1, 0.125), ("on_log", 1, True), ("on_step_end", 2, 0.25),
        ("on_log", 2, True), ("on_log", 2, False), ("on_evaluate", 2, sorted(lines[-1].keys() - {"step"})),
        ("on_save", 2), ("on_train_end", 2, 3)]
    *logged, summary = objects.state.log_history
    assert [{k: v for k, v in h.items() if k not in WALL_CLOCK} for h in logged] == lines
    # what TRL's train() returns (transformers' TrainOutput), its summary the last line of log_history
    from transformers.trainer_utils import TrainOutput

    losses = [m["loss"] for m in lines if "loss" in m]
    assert isinstance(output, TrainOutput) and output.global_step == 2
    assert output.training_loss == pytest.approx(sum(losses) / 2) and output.metrics["train_loss"] == output[1]
    assert set(output.metrics) == {"train_runtime", "train_samples_per_second", "train_steps_per_second",
                                   "train_loss", "epoch"} and summary == {**output.metrics, "step": 2}
    assert output.metrics["train_steps_per_second"] > 0 and output.metrics["epoch"] == 0.25

    stopper = Recorder(stop_at=1)
    paths = jodpo.OnlineDPOTrainer(
        model=policy, reward_funcs=reward, train_dataset=rows["train"], eval_dataset=evals, callbacks=[stopper],
        args=jodpo.OnlineDPOConfig(output_dir=str(tmp_path / "paths"), use_peft=True, lora_r=4, lora_alpha=8,
                                   lora_target_modules=["q_proj", "v_proj"], **tiny))
    paths.train()
    assert stopper.events[-2:] == [("on_save", 1), ("on_train_end", 1, 1)]
    assert [m["step"] for m in subproc.metrics_lines(tmp_path / "paths")] == [1]
    paths.callbacks = []
    assert paths.train().global_step == 2  # resumes from the stop's checkpoint
    assert subproc.metrics_lines(tmp_path / "paths") == lines
    assert paths.state.global_step == 2 and [h["step"] for h in paths.state.log_history] == [2, 2, 2]  # no callbacks
    adapter = objects.save_model(str(tmp_path / "adapter"))
    assert (adapter / "adapter_config.json").is_file()


def test_a_trainer_holds_a_state_before_it_trains(checkpoints):
    state = jodpo.OnlineDPOTrainer(str(checkpoints["qwen2"]["causal_lm"])).state  # transformers' TrainerState, as a TRL trainer holds from the start
    assert (state.global_step, state.log_history) == (0, [])


def test_a_jodpo_model_needs_its_tokenizer(checkpoints):
    pair = jodpo.load_model(str(checkpoints["qwen2"]["causal_lm"]))
    with pytest.raises(ConfigError, match="holds no tokenizer; give its tokenizer as processing_class"):
        jodpo.OnlineDPOTrainer(pair)
    with pytest.raises(ConfigError, match="not jodpo's \\(model, params\\)"):
        jodpo.OnlineDPOTrainer((1, 2))
    with pytest.raises(ConfigError, match="eval_dataset is an empty dict"):
        jodpo.OnlineDPOTrainer(str(checkpoints["qwen2"]["causal_lm"]), eval_dataset={})


def test_a_ref_model_of_its_own_is_the_reference(checkpoints, tmp_path):
    """TRL's ``ref_model``: the same weights as the policy log what no ref_model logs; other weights of the same
    architecture are the reference (the first step's KL, zero against the starting policy, is not); another
    architecture, or other weights than the base with ``peft_config`` (whose reference is the base), is refused in one
    line."""
    import jax

    data = hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    path = str(checkpoints["qwen2"]["causal_lm"])
    model, params = jodpo.load_model(path)
    shifted = (model, jax.tree.map(lambda x: x * 1.05, params))

    def run(out, **kw):
        args = jodpo.OnlineDPOConfig(output_dir=str(tmp_path / out), dataset_name=str(data / "train.jsonl"),
                                     reward_funcs=("jodpo.tasks.toy:sentiment_reward",), **{**TINY, "max_steps": 1})
        jodpo.OnlineDPOTrainer(path, args=args, **kw).train()
        return subproc.metrics_lines(tmp_path / out)

    alone, same, other = run("alone"), run("same", ref_model=path), run("other", ref_model=shifted)
    assert same == alone and alone[0]["objective/kl"] == 0.0
    assert abs(other[0]["objective/kl"]) > 1e-3 and other[0]["logps/chosen"] == alone[0]["logps/chosen"]
    with pytest.raises(ConfigError, match="ref_model is a llama model of other shapes than the policy"):
        run("llama", ref_model=str(checkpoints["llama"]["causal_lm"]))
    with pytest.raises(ConfigError, match="ref_model: with peft_config jodpo's reference is the base model with its "
                                          "adapters off, and this ref_model's weights are not the base's"):
        run("peft", ref_model=shifted, peft_config={"peft_type": "LORA", "r": 2, "lora_alpha": 4})


# TRL 1.16's quick start as a script that pushes to the Hub and saves and evaluates by steps, ending as TRL's example
# scripts end (save_model, push_to_hub), with only its import changed (`trl.experimental.online_dpo` -> `jodpo`)
PUSHING = """
import sys
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from jodpo import OnlineDPOConfig, OnlineDPOTrainer


def reward_len(completions, **kwargs):
    return [-abs(8 - len(c)) / 8 for c in completions]


model_dir, data_dir, out, export, tiny = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
training_args = OnlineDPOConfig(
    output_dir=out, push_to_hub=True, hub_model_id="tiny-online-dpo", hub_token="hf_stand_in", save_strategy="steps",
    save_steps=2, eval_strategy="steps", eval_steps=2, logging_first_step=True, logging_steps=2, **eval(tiny))
trainer = OnlineDPOTrainer(
    model=model, reward_funcs=reward_len, args=training_args, processing_class=tokenizer,
    train_dataset=Dataset.from_json(f"{data_dir}/train.jsonl"),
    eval_dataset=Dataset.from_json(f"{data_dir}/test.jsonl"))
trainer.train()
trainer.save_model(export)
trainer.push_to_hub()
"""


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _exported(files: dict[str, bytes]) -> dict[str, bytes]:
    """An export's files, its tokenizer_config.json without the ``local_files_only`` it records (whether the
    tokenizer was read offline: the test's process is, the script's is not)."""
    config = json.loads(files["tokenizer_config.json"])
    config.pop("local_files_only", None)
    return files | {"tokenizer_config.json": json.dumps(config, sort_keys=True).encode()}


def test_a_trl_script_that_pushes_saves_and_evaluates_by_steps(checkpoints, tmp_path):
    """Issue 59: push_to_hub, save_strategy, eval_strategy and logging_first_step were refused. The script runs: step
    1 is logged besides every logging_steps (and the last), evaluations and saves come every 2 steps and at the end,
    each save is pushed as the policy exported from it (transformers' "Training in progress, step N"), then the
    script's save_model ("Model save") and push_to_hub ("End of training"): the repo holds the export."""
    data = hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    out, export, script = tmp_path / "run", tmp_path / "export", tmp_path / "train_online_dpo.py"
    script.write_text(PUSHING)
    tiny = {k: v for k, v in TINY.items() if k != "logging_steps"} | dict(max_steps=3, max_eval_prompts=4,
                                                                            per_device_eval_batch_size=2)
    hub = hub_stand_in.HubStandIn()
    try:
        done = subprocess.run([sys.executable, str(script), str(checkpoints["qwen2"]["causal_lm"]), str(data),
                               str(out), str(export), repr(tiny)], cwd=tmp_path, capture_output=True, text=True,
                              env=subproc.env(**hub_stand_in.environment(hub)), timeout=600)
    finally:
        hub.close()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = subproc.metrics_lines(out)
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3]
    assert [m["step"] for m in lines if "eval/objective/scores" in m] == [2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "3"]
    assert json.loads((out / "config.json").read_text())["hub_token"] == "<HUB_TOKEN>"
    from jodpo.program.trained_policy import export_run

    repo = "stand-in-user/tiny-online-dpo"
    assert list(hub.repos) == [repo] and [c["summary"] for c in hub.commits] == [
        "Training in progress, step 2", "Training in progress, step 3", "Model save", "End of training"]
    assert _exported(hub.commits[0]["added"]) == _exported(_files(export_run(out, tmp_path / "step2",
                                                                             out / "checkpoints" / "2")))
    exported = _files(export)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(exported)
    assert hub.files(repo) == exported == hub.commits[1]["added"]
    assert "pushed step 2 to the Hub (stand-in-user/tiny-online-dpo, hub_strategy='every_save')" in done.stdout


class _Preempted:
    """A callback standing in for a preemption: SIGTERM at the end of step 1."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_evaluating_a_scripts_own_rows_needs_an_eval_dataset(checkpoints, tmp_path):
    from datasets import Dataset

    from jodpo.program.run import build

    rows = Dataset.from_json(str(hf_fixtures.prompt_dataset(tmp_path / "data") / "train.jsonl"))
    trainer = jodpo.OnlineDPOTrainer(str(checkpoints["qwen2"]["causal_lm"]), reward_funcs=_reward_len,
                                     train_dataset=rows, args=jodpo.OnlineDPOConfig(str(tmp_path / "out"),
                                                                                    eval_strategy="steps", **TINY))
    with pytest.raises(ConfigError, match=re.escape("eval_strategy='steps' needs an eval_dataset (as transformers' "
                                                    "Trainer requires one): give the trainer eval_dataset, or set "
                                                    "eval_strategy='no'")):
        build(trainer.args, trainer.given)


def _reward_len(completions, **kwargs):
    return [-abs(8 - len(c)) / 8 for c in completions]


def test_epoch_and_no_strategies_and_a_pushed_checkpoint_that_resumes(checkpoints, tmp_path, monkeypatch):
    """save/eval/logging_strategy="epoch" act at each epoch's end and the run's end; hub_strategy="checkpoint" pushes
    the resumable run to last-checkpoint/ (the older one replaced), which resumes once downloaded; "no" saves,
    evaluates and logs nothing (but logging_first_step), and save_model() exports the policy train() ended with."""
    from datasets import Dataset

    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    rows = Dataset.from_json(str(data / "train.jsonl")).select(range(4))  # 2 steps an epoch, at 2 prompts a step
    evals = Dataset.from_json(str(data / "test.jsonl")).select(range(4))
    policy = str(checkpoints["qwen2"]["causal_lm"])
    tiny = {**TINY, "max_steps": 3, "max_eval_prompts": 4, "per_device_eval_batch_size": 2}
    hub = hub_stand_in.HubStandIn()
    hub_stand_in.patch(hub, monkeypatch)
    try:
        args = jodpo.OnlineDPOConfig(str(tmp_path / "epoch"), save_strategy="epoch", eval_strategy="epoch",
                                     logging_strategy="epoch", eval_on_start=True, push_to_hub=True,
                                     hub_strategy="checkpoint", hub_private_repo=True, hub_revision="dev", **tiny)
        jodpo.OnlineDPOTrainer(policy, reward_funcs=_reward_len, args=args, train_dataset=rows,
                               eval_dataset=evals).train()
        lines = subproc.metrics_lines(tmp_path / "epoch")
        assert [m["step"] for m in lines if "loss" in m] == [2, 3]
        assert [m["step"] for m in lines if "eval/win_rate" in m] == [0, 2, 3]  # eval_on_start: the policy at step 0
        assert sorted(p.name for p in (tmp_path / "epoch" / "checkpoints").iterdir()) == ["2", "3"]
        assert [c["summary"] for c in hub.commits] == ["Training in progress, epoch 1",
                                                       "Training in progress, epoch 1, checkpoint"] * 2
        assert hub.repos["stand-in-user/epoch"]["private"] and {c["revision"] for c in hub.commits} == {"dev"}
        pushed = hub.files("stand-in-user/epoch", "dev")
        run = {p[len("last-checkpoint/"):]: b for p, b in pushed.items() if p.startswith("last-checkpoint/")}
        assert {"config.json", "source_model/config.json"} <= set(run) and not any("checkpoints/2/" in p for p in run)
        assert run == {p: b for p, b in _files(tmp_path / "epoch").items()
                       if p in ("config.json",) or p.startswith(("source_model/", "checkpoints/3/"))}
    finally:
        hub.close()
    downloaded = tmp_path / "downloaded"
    for path, content in run.items():
        (downloaded / path).parent.mkdir(parents=True, exist_ok=True)
        (downloaded / path).write_bytes(content)
    resumed = jodpo.OnlineDPOTrainer(policy, reward_funcs=_reward_len, train_dataset=rows, eval_dataset=evals,
                                     args=args.replace(output_dir=str(downloaded), max_steps=4, push_to_hub=False))
    assert resumed.train(allow_config_change=True).global_step == 4  # max_steps 3 -> 4
    assert [m["step"] for m in subproc.metrics_lines(downloaded) if "loss" in m] == [4]

    args = jodpo.OnlineDPOConfig(str(tmp_path / "none"), save_strategy="no", eval_strategy="no",
                                 logging_strategy="no", logging_first_step=True, **tiny)
    trainer = jodpo.OnlineDPOTrainer(policy, reward_funcs=_reward_len, args=args, train_dataset=rows,
                                     eval_dataset=evals, callbacks=[_Preempted()])

    def unused():
        return pytest.warns(UserWarning, match="eval_strategy='no' \\(TRL's default\\): the run does not evaluate")

    with pytest.raises(Stopped, match=re.escape("stopped by SIGTERM at step 1; nothing saved (save_strategy='no'): a "
                                                "run started again begins at step 0")), unused():
        trainer.train()
    trainer.callbacks = []
    with unused():
        trainer.train()
    assert [m["step"] for m in subproc.metrics_lines(tmp_path / "none")] == [1]
    assert not any((tmp_path / "none" / "checkpoints").iterdir())
    with pytest.warns(UserWarning, match="names the run's output_dir, whose config.json and checkpoints/ are the "
                                         "run's"):
        saved = trainer.save_model(str(tmp_path / "none"))  # TRL's scripts save to output_dir
    assert saved == tmp_path / "none" / "final" and json.loads((tmp_path / "none" / "config.json").read_text())[
        "save_strategy"] == "no"
    model, params = jodpo.load_model(str(saved))
    assert model.vocab_size == jodpo.load_model(policy)[0].vocab_size

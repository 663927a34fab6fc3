"""The training program end to end: the tiny default learns, every config file runs on local stand-ins,
outputs have the names outside tools read, a stopped run resumes exactly, offline DPO runs."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import jodpo
from jodpo.program import config as C
from jodpo.program import data as D
from jodpo.program import sources
from jodpo import train
from jodpo.program import loop
from jodpo.program.tracking import wandb_name
from tests import hf_fixtures, wandb_files
from tests.subproc import WALL_CLOCK

CONFIGS = sorted(p.name for p in C.CONFIGS_DIR.glob("*.py") if p.name != "__init__.py")
TRL_NAMES = ["loss", "grad_norm", "learning_rate", "episode", "step", "epoch", "eps", "objective/kl", "objective/entropy",
             "objective/non_score_reward", "objective/rlhf_reward", "objective/scores", "objective/scores_margin",
             "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected", "val/contain_eos_token", "beta"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_tiny_default_learns_and_writes_every_output(tiny_run):
    lines = [m for m in _metrics(tiny_run) if "loss" in m]
    for name in TRL_NAMES:
        assert name in lines[0], name
    scores = np.array([m["objective/scores"] for m in lines])
    q = len(scores) // 4  # from the first logs (steps 10 and 20: it learns within tens of steps) to the last quarter
    first, last = scores[:2].mean(), scores[-q:].mean()
    noise = np.abs(np.diff(scores[-q:])).mean()
    assert last > first + 0.4 and last - first > 5 * noise, (scores, noise)
    evals = [m for m in _metrics(tiny_run) if "eval/objective/scores" in m]
    assert evals and evals[-1]["step"] == lines[-1]["step"] == 200
    assert (tiny_run / "config.json").exists() and any((tiny_run / "tensorboard").iterdir())
    assert sorted(int(p.name) for p in (tiny_run / "checkpoints").iterdir() if p.name.isdigit()) == [100, 200]


def test_stopped_run_resumes_exactly(tiny_run, tmp_path, monkeypatch):
    """Lose the last checkpoint (as if stopped after step 100): the rerun continues from 100 and ends with
    the same metrics, bit for bit. It reads the checkpoint straight into its layout: while it does, the device
    holds no first state of the run (the weights it loaded, and the reward model, but not a second state)."""
    out = tmp_path / "resumed"
    shutil.copytree(tiny_run, out)
    shutil.rmtree(out / "checkpoints" / "200")
    before, seen = _live_bytes(), []
    restore = loop.Checkpointer.restore_latest

    def watched(self, layout):
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout))
        seen.append((_live_bytes() - before, state_bytes))
        return restore(self, layout)

    monkeypatch.setattr(loop.Checkpointer, "restore_latest", watched)
    assert train.main(["--config", "tiny.py", f"--config.output_dir={out}"]) == 0
    [(held, state_bytes)] = seen
    assert 0 < held < state_bytes, (held, state_bytes)
    # Resuming with another config is refused (naming the field) and destroys nothing.
    before = (out / "metrics.jsonl").read_text()
    assert train.main(["--config", "tiny.py", f"--config.output_dir={out}", "--config.learning_rate=0.1"]) == 2
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoints" / "200").is_dir()
    a = [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in _metrics(tiny_run)]
    b = [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in _metrics(out)]
    assert a == b


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_a_resumed_run_reads_no_policy_weights_of_its_own_dtype(checkpoints, tmp_path, monkeypatch, loss_type):
    """A float32 policy beside a bfloat16 reference (frozen_param_dtype): a fresh run reads the weights once per
    dtype; a resumed run reads only the reference's (and the reward model), its policy being in the checkpoint;
    and it ends as the uninterrupted run does, bit for bit. With a reference-free loss (simpo) no reference is read
    or held at all: a fresh run reads the policy once, a resumed one no causal LM, and the metrics that need a
    reference are not logged. The simpo run passes twice over each rollout (num_epochs=2: rollout_update, which then
    computes no reference log-probs). Both report to W&B too (offline): the run's W&B files hold metrics.jsonl under
    TRL's W&B names, the completion tables and the config, and the resumed run continues the same W&B run."""
    import wandb  # here, not at the top: the GPU image has no wandb, and this test is not a weighty one

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "jodpo-tests")
    for name in ("WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    cfg = C.TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                        reward_model_path=str(checkpoints["llama"]["reward"]),
                        dataset_name=str(hf_fixtures.prompt_dataset(tmp_path / "data")), output_dir=str(out),
                        max_steps=2, save_steps=1, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
                        max_new_tokens=6, max_length=120, max_prompt_length=96, prompt_buckets=(96,), bf16=False,
                        frozen_param_dtype="bfloat16", report_to=("tensorboard", "wandb"), run_name="resumable",
                        loss_type=loss_type, num_epochs=2 if loss_type == "simpo" else 1)
    reads, load, runs, build = [], sources.load_model, [], loop.build

    def counted(path, task="causal_lm", dtype="float32", **kwargs):
        reads.append((task, str(dtype)))
        return load(path, task, dtype, **kwargs)

    monkeypatch.setattr(sources, "load_model", counted)
    monkeypatch.setattr(loop, "build", lambda cfg, given: runs.append(build(cfg, given)) or runs[-1])
    loop.train(cfg)
    reference = [("causal_lm", "bfloat16")] if loss_type == "sigmoid" else []
    assert sorted(reads) == sorted(reference + [("causal_lm", "float32"), ("reward", "bfloat16")])
    assert (runs[0].ref_params is None) == (loss_type == "simpo")
    wandb.teardown()  # W&B's service finishes writing the run's file after run.finish() returns; this waits for it
    first = wandb_files.offline_run(out)
    assert first["history"] == [{wandb_name(k): v for k, v in m.items()} for m in _metrics(out)]
    assert {"train/loss", "train/objective/scores", "train/global_step"} <= set(first["history"][0])
    [(_, step_1), (_, step_2)] = [(len(t), t[0]["step"]) for t in first["tables"]["completions"]]
    assert (step_1, step_2) == (1, 2) and set(first["tables"]["completions"][0][0]) == {"step", "prompt",
                                                                                          "completion", "score"}
    assert first["config"] == json.loads((out / "config.json").read_text())
    assert (first["name"], first["project"]) == ("resumable", "jodpo-tests")
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "2")
    shutil.rmtree(resumed / "wandb")  # the W&B files already synced (or kept elsewhere); the run's id stays
    reads.clear()
    loop.train(cfg.replace(output_dir=str(resumed)))
    assert sorted(reads) == reference + [("reward", "bfloat16")]
    strip = lambda p: [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in _metrics(p)]  # noqa: E731
    assert strip(resumed) == strip(out)
    wandb.teardown()
    second = wandb_files.offline_run(resumed)
    assert second["id"] == first["id"] and [h["train/global_step"] for h in second["history"]] == [2]
    logged = set(_metrics(out)[0])
    assert {"loss", "rewards/chosen", "logps/chosen", "objective/scores", "objective/entropy"} <= logged
    assert ("objective/kl" in logged) == (loss_type == "sigmoid")


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "tiny.py"])
def test_every_config_runs_two_steps_on_local_stand_ins(name, checkpoints, tmp_path):
    cfg = C.load_config_file(name)

    def stand_in(hub_name: str) -> str:  # the tiny fixture of a hub checkpoint's family
        return next((f for key, f in (("30b-a3b", "qwen3_moe"), ("qwen3.5", "qwen3_5"), ("qwen3", "qwen3"),
                                      ("gemma-3", "gemma3"), ("gemma-4", "gemma4"), ("qwen", "qwen2"))
                     if key in hub_name.lower()), "neox")

    family = stand_in(cfg.model_name_or_path)
    chat = "ultrafeedback" in cfg.dataset_name
    # open-instruct's recipe reads a preference dataset's prompts (online, since the run has a reward model)
    # a reward reading the instruction columns (smollm2_ifeval.py) gets prompts carrying them
    instructions = any("instructions" in f for f in cfg.reward_funcs)
    data = str(hf_fixtures.prompt_dataset(tmp_path / "data", chat, preference=cfg.dataset_mixer is not None,
                                          instructions=instructions))
    source = {"dataset_mixer": {data: 1.0}, "dataset_eval_mixer": {data: 1.0}, "dataset_test_split": "test"} \
        if cfg.dataset_mixer else {"dataset_name": data, "eval_dataset": None, "dataset_test_split": "test"}
    P = 320 if instructions else 96  # the instructions' text is ~300 tokens of the tiny character-level tokenizer
    # a judge recipe is judged by a tiny causal LM, any other one scored by a tiny reward model of its reward model's
    # family (Skywork's Qwen3 reward models for the Qwen3.5 and Gemma recipes)
    scorer = {"judge": str(checkpoints["llama"]["causal_lm"])} if cfg.judge else {
        "reward_model_path": str(checkpoints[stand_in(cfg.reward_model_path or cfg.model_name_or_path)]["reward"])}
    cfg = cfg.replace(model_name_or_path=str(checkpoints[family]["causal_lm"]), **scorer, **source,
                      output_dir=str(tmp_path / "out"), total_episodes=None, max_steps=2, per_device_train_batch_size=2,
                      max_new_tokens=6, max_length=P + 24, max_prompt_length=P, eval_strategy="steps", eval_steps=2,
                      max_eval_prompts=4,
                      per_device_eval_batch_size=2, logging_steps=1,
                      prompt_buckets=(P,),  # one prompt shape: each program compiles once (the prompts straddle 64)
                      mesh_expert=1)  # a pod recipe's expert axis, on this one device
    last = loop.train(cfg)
    lines = _metrics(tmp_path / "out")
    assert [m["step"] for m in lines if "loss" in m] == [1, 2]
    assert np.isfinite(last["loss"]) and 0 <= last["eval/win_rate"] <= 1
    assert json.loads((tmp_path / "out" / "config.json").read_text())["learning_rate"] == cfg.learning_rate
    assert (tmp_path / "out" / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize("chat", [False, True])
def test_offline_dpo_from_preference_data(checkpoints, tmp_path, chat):
    if chat:  # conversational preference data: the responses are what the chat template adds after the prompt
        rows = [{"prompt": [{"role": "user", "content": f"hello world {i}"}],
                 "chosen": [{"role": "assistant", "content": "the quick brown fox"}],
                 "rejected": [{"role": "assistant", "content": "lazy dog"}]} for i in range(8)]
    else:
        rows = [{"prompt": f"hello world {i}", "chosen": " the quick brown fox", "rejected": " lazy dog"}
                for i in range(8)]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = C.TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]), dataset_name=str(data),
                        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                        learning_rate=1e-3, logging_steps=1, max_new_tokens=8, bf16=False)
    with pytest.raises(C.ConfigError, match="num_generations, pairing and sync_steps shape online rollouts"):
        loop.train(cfg.replace(num_generations=4, output_dir=str(tmp_path / "refused")))
    loop.train(cfg)
    tok = jodpo.load_tokenizer(cfg.model_name_or_path)
    prefs = D.prepare_preferences(D.load_rows(str(data)), tok, 64, 64)
    expect = "the quick brown fox<|endoftext|>" if chat else " the quick brown fox<|endoftext|>"
    assert tok.decode(prefs.chosen_ids[0]) == expect
    lines = _metrics(tmp_path / "out")
    assert lines[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # policy == reference at the first step
    assert lines[-1]["rewards/margins"] > 0  # and then it prefers the chosen responses


def test_open_instruct_passes_over_each_rollout_resume_exactly(checkpoints, tmp_path, capsys):
    """num_epochs=2 x num_mini_batches=2 with async_mode: four optimizer steps per rollout (the learning-rate
    horizon is the rollouts times four), the off-policy KL logged, and a run stopped after a rollout resumes (its
    lagging sampler included) to the same metrics, bit for bit. The rollouts are best-of-3 pairs (num_generations=3)
    and the sampler is refreshed every other rollout (sync_steps=8), so their resume is exact too. On one mesh the
    run says that sampling and the update take turns."""
    out = tmp_path / "out"
    cfg = C.TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                        reward_model_path=str(checkpoints["llama"]["reward"]),
                        dataset_name=str(hf_fixtures.prompt_dataset(tmp_path / "data")), output_dir=str(out),
                        max_steps=3, save_steps=1, per_device_train_batch_size=2, learning_rate=1e-3,
                        logging_steps=1, max_new_tokens=6, max_length=96, max_prompt_length=64, bf16=False,
                        num_epochs=2, num_mini_batches=2, async_mode=True, num_generations=3, sync_steps=8)
    loop.train(cfg)
    said = capsys.readouterr().out
    assert "async_mode: sampling and the update take turns on the same devices" in said
    assert ("nothing to overlap on one device" if jax.device_count() == 1 else "sampler_devices=k gives") in said
    lines = [m for m in _metrics(out) if "loss" in m]
    assert all("objective/off_policy_kl" in m and "frac_reward_zero_std" in m for m in lines)
    assert [m["step"] for m in lines] == [1, 2, 3] and [m["episode"] for m in lines] == [4, 8, 12]
    # the rate of each step's last update, the 4th, 8th and 12th of 12: linear decay without warm-up
    assert [m["learning_rate"] for m in lines] == pytest.approx([1e-3 * 9 / 12, 1e-3 * 5 / 12, 1e-3 * 1 / 12], abs=1e-9)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    loop.train(cfg.replace(output_dir=str(resumed)))
    strip = lambda p: [{k: v for k, v in m.items() if k not in WALL_CLOCK} for m in _metrics(p)]  # noqa: E731
    assert strip(resumed) == strip(out)

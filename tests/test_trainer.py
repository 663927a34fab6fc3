"""TRL's Python API: TRL's documented online-DPO example, with only its import changed, runs on jodpo (tiny local
stand-ins for its model, tokenizer and dataset, a Python reward function) and logs what the command line logs for
the same config, in the same process."""
import json
import textwrap

import pytest

import jodpo
from jodpo import train
from jodpo.errors import ConfigError
from tests import hf_fixtures, subproc

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


def test_trls_example_with_its_import_changed_logs_what_the_command_line_logs(checkpoints, tmp_path, monkeypatch):
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
           *[f"--config.{k}={v!r}" for k, v in TINY.items() if k != "prompt_buckets"]]
    assert train.main(cli) == 0  # a second run in the same process
    api, command = subproc.metrics_lines(tmp_path / "api"), subproc.metrics_lines(tmp_path / "cli")
    assert [m["step"] for m in api] == [1, 2] and api == command

    out = scope["trainer"].save_model(str(tmp_path / "saved"))
    reread, _ = jodpo.load_model(str(out))
    assert reread.vocab_size == jodpo.load_model(model)[0].vocab_size


def test_trls_arguments_jodpo_has_no_use_for_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="unknown field.*Did you mean 'learning_rate'"):
        jodpo.OnlineDPOConfig(output_dir="x", learnin_rate=1e-6)
    assert jodpo.OnlineDPOConfig("x", beta=[0.2]).beta == 0.2  # TRL's one-element list, a float as in TRL
    with pytest.raises(ConfigError, match="ref_model is always the starting policy"):
        jodpo.OnlineDPOTrainer("m", ref_model="m")
    with pytest.raises(ConfigError, match="optimizers is a torch Trainer's"):
        jodpo.OnlineDPOTrainer("m", optimizers=(object(), None))
    trainer = jodpo.OnlineDPOTrainer("m", peft_config={"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                        "target_modules": ["q_proj", "v_proj"]})
    args = trainer.args
    assert (args.use_peft, args.lora_r, args.lora_alpha, args.lora_target_modules) == (True, 4, 8, ("q_proj", "v_proj"))

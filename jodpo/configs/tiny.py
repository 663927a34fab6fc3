"""The embedded default: a tiny random Llama learns to write positive reviews, in a few minutes on a CPU.

Downloads nothing: the model, tokenizer and prompts are built in code (jodpo/tasks/toy.py) on first use, and the
reward is a Python function (the sentiment of the completion). The logged `objective/scores` climbs from
about 0 towards 1.
"""
from jodpo.tasks import toy
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    world = toy.world_dir()
    return TrainConfig(
        model_name_or_path=str(world / "model"),
        reward_funcs=("jodpo.tasks.toy:sentiment_reward",),
        dataset_name=str(world / "prompts.jsonl"),
        eval_dataset=str(world / "eval.jsonl"),
        dataset_test_split="train",  # a single local file is one split
        max_eval_prompts=32,
        output_dir="runs/tiny",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=200,
        learning_rate=3e-3,
        warmup_ratio=0.1,
        beta=0.1,
        max_new_tokens=12,
        max_length=64,
        max_prompt_length=16,
        temperature=1.0,
        logging_steps=10,
        save_steps=100,
        eval_strategy="steps",
        eval_steps=100,
        num_sample_generations=4,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )

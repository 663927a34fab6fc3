"""Qwen2-0.5B-Instruct with the Qwen2-0.5B reward model on UltraFeedback prompts (chat data), as TRL's
Online DPO documentation runs it (with a reward model in place of the PairRM judge)."""
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model_name_or_path="Qwen/Qwen2-0.5B-Instruct",
        reward_model_path="trl-lib/Qwen2-0.5B-Reward",
        dataset_name="trl-lib/ultrafeedback-prompt",
        output_dir="Qwen2-0.5B-Online-DPO",
        learning_rate=5.0e-7,
        warmup_ratio=0.1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_new_tokens=64,
        missing_eos_penalty=1.0,
        eval_strategy="steps",
        eval_steps=500,
        dataset_test_split="test",
        save_total_limit=2,  # 12 bytes a parameter each (float32 weights + Adam): about 6 GB for 0.5B
    )

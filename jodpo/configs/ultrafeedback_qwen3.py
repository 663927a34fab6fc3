"""Qwen3-1.7B with the Skywork-Reward-V2 Qwen3-1.7B reward model on UltraFeedback prompts (chat data), at TRL's Online
DPO settings (as ultrafeedback_qwen2.py). Both share Qwen3's tokenizer, so the rewards are read from the policy's
token ids on the device. Qwen3's EOS ids (<|im_end|>, <|endoftext|>) come from its generation_config.json; its chat
template renders the prompts as TRL renders them (thinking on, the template's default)."""
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model_name_or_path="Qwen/Qwen3-1.7B",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-1.7B",
        dataset_name="trl-lib/ultrafeedback-prompt",
        output_dir="Qwen3-1.7B-Online-DPO",
        learning_rate=5.0e-7,
        warmup_ratio=0.1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_new_tokens=64,
        missing_eos_penalty=1.0,
        frozen_param_dtype="bfloat16",  # the reference and reward model are never updated
        eval_steps=500,
        dataset_test_split="test",
        save_total_limit=2,  # 12 bytes a parameter each (float32 weights + Adam): about 20 GB for 1.7B
    )

"""Qwen3-1.7B with the Skywork-Reward-V2 Qwen3-1.7B reward model on UltraFeedback prompts (chat data), at TRL's Online
DPO settings (as ultrafeedback_qwen2.py). Both share Qwen3's tokenizer, so the rewards are read from the policy's
token ids on the device. Qwen3's EOS ids (<|im_end|>, <|endoftext|>) come from its generation_config.json; its chat
template renders the prompts as TRL renders them (thinking on, the template's default). What fits on TPUs (docs/tpu.md,
compiled for each chip ahead of time): one v5p chip, a v5litepod-8 or 8 v6e chips; not one v5e or v6e chip
(use_peft=True fits one v5e chip)."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen2.py").replace(
        model_name_or_path="Qwen/Qwen3-1.7B",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-1.7B",
        output_dir="Qwen3-1.7B-Online-DPO",
        frozen_param_dtype="bfloat16",  # the reference and reward model are never updated
    )  # save_total_limit 2: 12 bytes a parameter each (float32 weights + Adam), about 20 GB for 1.7B

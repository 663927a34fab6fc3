"""Qwen3.5-0.8B (the hybrid of Gated DeltaNet and gated attention layers) with the Skywork-Reward-V2 Qwen3-1.7B reward
model on UltraFeedback prompts (chat data), at TRL's Online DPO settings (as ultrafeedback_qwen2.py). Qwen3.5's
tokenizer (248,320 entries) is not the reward model's (Qwen3's), so each completion is decoded and re-tokenized with
the reward model's own tokenizer and chat template before it is scored (the reward model still runs on the device).
The checkpoint on the hub is a Qwen3_5ForConditionalGeneration: its language model is trained, its vision tower and
multi-token-prediction layer are left out (one line says so), and an export is a Qwen3_5ForCausalLM. Qwen3.5's EOS ids
come from its generation_config.json; its chat template renders the prompts as TRL renders them (its default).
TPU chips (docs/tpu.md's grid, at this batch, with a reward model of the policy's shape): full fine-tuning does not fit
one v5e chip (20.5 GiB of temporaries asked); one v6e or v5p chip and 8 chips are not compiled yet."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen2.py").replace(
        model_name_or_path="Qwen/Qwen3.5-0.8B",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-1.7B",
        output_dir="Qwen3.5-0.8B-Online-DPO",
        frozen_param_dtype="bfloat16",  # the reference and reward model are never updated
    )  # save_total_limit 2: 12 bytes a parameter each (float32 weights + Adam), about 9 GB for 0.75B

"""gemma-3-1b-it on UltraFeedback prompts (chat data) on a TPU, scored by the Skywork-Reward-V2 Qwen3-0.6B reward model
(its own tokenizer: completions are decoded and re-tokenized for it), at TRL's Online DPO settings. jodpo's defaults
suit a TPU: bf16 compute with float32 master weights, the layers rematerialised, the batch split over every chip of
the slice with the weights, gradients and Adam state (mesh_fsdp=-1); the frozen reference and reward model are read
in bf16. What fits (docs/tpu.md, compiled for each chip ahead of time): one v6e or v5p chip, or a v5litepod-8; not one
v5e chip (use_peft=True fits there)."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen2.py").replace(
        model_name_or_path="google/gemma-3-1b-it",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-0.6B",
        output_dir="gemma-3-1b-it-Online-DPO",
        frozen_param_dtype="bfloat16",
    )

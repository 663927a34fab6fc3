"""Qwen3-30B-A3B (a mixture of experts: 128 experts of 768, 8 a token; 30.5 B parameters, 3.3 B active) with the
Skywork-Reward-V2 Qwen3-1.7B reward model on UltraFeedback prompts (chat data), at TRL's Online DPO settings (as
ultrafeedback_qwen2.py). Both share Qwen3's tokenizer, so the rewards are read from the policy's token ids on the
device. The experts run dropless (no token dropped, transformers' routing exactly: docs/models.md); no load-balancing
loss is added (``router_aux_loss_coef=0``, as TRL's online trainers: set it to add transformers' ``aux_loss``, logged
as ``aux_loss``). Routing replay is on (``moe_routing_replay``): the bf16 sampler and the training forward route some
near-tie tokens to different experts (``moe/route_flip_rate`` says how many), and the collapse of Qwen3-30B-A3B RL runs
reported in 2026 came from training log-probs of routes that never sampled. Full fine-tuning holds 12 bytes a
parameter (float32 weights and Adam), about 370 GB: a pod slice with the parameters split over ``fsdp`` and the
experts over ``expert``: ultrafeedback_qwen3_moe_tpu.py, compiled for a v5p-32 (docs/tpu.md)."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen2.py").replace(
        model_name_or_path="Qwen/Qwen3-30B-A3B",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-1.7B",
        output_dir="Qwen3-30B-A3B-Online-DPO",
        frozen_param_dtype="bfloat16",  # the reference and reward model are never updated
        moe_routing_replay=True,  # the policy's forward takes the experts its sampler chose (docs/models.md)
    )

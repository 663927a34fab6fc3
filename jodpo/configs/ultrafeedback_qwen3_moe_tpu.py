"""Qwen3-30B-A3B (128 experts of 768, 8 a token; 30.5 B parameters, 3.3 B active) on a TPU v5p pod slice, scored by
the Skywork-Reward-V2 Qwen3-1.7B reward model on UltraFeedback prompts (chat data), at TRL's Online DPO settings, as
ultrafeedback_qwen3_moe.py. jodpo's TPU defaults (bf16 compute with float32 master weights, the layers
rematerialised, the frozen reference and reward model in bf16) with an expert axis: ``mesh_expert=8`` splits the
experts (29 of the 30.5 B parameters) eight ways by expert, 16 experts a chip, with their gradients and Adam moments,
and ``mesh_fsdp=-1`` splits everything over the chips the expert axis leaves (the batch and the other parameters over
both). Full fine-tuning holds about 24 bytes a parameter at the step's peak (float32 weights, Adam, the gradient sum,
the bf16 weights and gradient: docs/tpu.md), about 680 GiB: a v5p-32 (16 chips, fsdp 2 x expert 8), where XLA:TPU
compiles its step at a peak of 50.7 GiB a chip of 95, or larger. LoRA (``use_peft=True``) trains on fewer chips
(8 v5p: 25.7 GiB a chip): docs/tpu.md's grid."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen3_moe.py").replace(
        output_dir="Qwen3-30B-A3B-Online-DPO-TPU",
        mesh_expert=8,
        mesh_fsdp=-1,
    )

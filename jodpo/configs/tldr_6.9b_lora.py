"""TRL's Pythia-6.9B TL;DR recipe with LoRA adapters (TRL's peft_config, its ModelConfig names): one 80 GB GPU
instead of a node.

Only the adapters train: rank 16 on every projection of every layer (34M parameters, 0.5% of 6.9B), alpha 32.
The reference is the base model with the adapters off, so the frozen 6.9B policy exists once, in bfloat16
(frozen_param_dtype), beside the bfloat16 reward model: 2 x 13.8 GB of weights, the adapters and their AdamW moments
(0.4 GB in float32), and checkpoints that hold the adapters alone (0.4 GB each, not 83 GB). LoRA learns slower per
step than full fine-tuning, so the learning rate is 10x the full recipe's (5e-6 instead of 5e-7). docs/tpu.md has
the arithmetic."""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("tldr_6.9b.py").replace(
        output_dir="pythia-6.9b-deduped-tldr-online-dpo-lora",
        use_peft=True,
        lora_r=16,
        lora_alpha=32,
        lora_target_modules=("all-linear",),
        learning_rate=5.0e-6,
        save_total_limit=3,
    )

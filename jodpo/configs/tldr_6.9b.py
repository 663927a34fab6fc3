"""TRL's Pythia-6.9B TL;DR recipe: 4 prompts per device, 4 accumulation steps, gradient checkpointing.

jodpo adds: the frozen reference and reward model read in bfloat16 (they are never updated). With bf16 compute the
program keeps them in bf16 in any case (as their forwards read them); reading them so never holds a float32 copy,
not even while loading (docs/tpu.md)."""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("tldr.py").replace(
        model_name_or_path="trl-lib/pythia-6.9b-deduped-tldr-sft",
        reward_model_path="trl-lib/pythia-6.9b-deduped-tldr-rm",
        output_dir="pythia-6.9b-deduped-tldr-online-dpo",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        gradient_checkpointing=True,
        frozen_param_dtype="bfloat16",
    )

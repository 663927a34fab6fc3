"""gemma-3-1b-it on UltraFeedback prompts (chat data) on a TPU, scored by the Skywork-Reward-V2 Qwen3-0.6B reward model
(its own tokenizer: completions are decoded and re-tokenized for it), at TRL's Online DPO settings. jodpo's defaults
suit a TPU: bf16 compute with float32 master weights, the layers rematerialised, the batch split over every chip of
the slice with the weights, gradients and Adam state (mesh_fsdp=-1); the frozen reference and reward model are read
in bf16."""
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model_name_or_path="google/gemma-3-1b-it",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-0.6B",
        dataset_name="trl-lib/ultrafeedback-prompt",
        output_dir="gemma-3-1b-it-Online-DPO",
        learning_rate=5.0e-7,
        warmup_ratio=0.1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_new_tokens=64,
        missing_eos_penalty=1.0,
        frozen_param_dtype="bfloat16",
        eval_steps=500,
        dataset_test_split="test",
        save_total_limit=2,
    )

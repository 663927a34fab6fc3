"""gemma-4-E2B-it on UltraFeedback prompts (chat data) on a TPU, scored by the Skywork-Reward-V2 Qwen3-1.7B reward model
(its own tokenizer: completions are decoded and re-tokenized for it), at TRL's Online DPO settings, as
ultrafeedback_gemma3_tpu.py. The checkpoint on the hub is a Gemma4ForConditionalGeneration: its language model is
trained (sliding and global attention of two shapes, per-layer embeddings, the last 20 layers reusing earlier layers'
keys and values), its vision and audio towers left out (one line says so); an export is a Gemma4ForCausalLM. Gemma 4's
EOS ids (<eos>, <turn|>) come from its generation_config.json. jodpo's TPU defaults: bf16 compute with float32 master
weights, the layers rematerialised, the batch, weights, gradients and Adam state split over every chip of the slice
(mesh_fsdp=-1; the per-layer table too), the frozen reference and reward model in bf16. Its 4.6 B parameters (2.3 B
of them the per-layer table) are 56 GB as float32 weights and Adam moments (12 bytes each), more than one v5e or v6e
chip holds, and XLA:TPU refuses its step on 8 v5e chips too (temporaries 35.5 GiB a chip: docs/tpu.md): a v6e or v5p
slice, or use_peft=True (PEFT's defaults, q_proj and v_proj), whose cells the tpu-grid has not compiled yet."""
from jodpo import TrainConfig
from jodpo.program.config import load_config_file


def get_config() -> TrainConfig:
    return load_config_file("ultrafeedback_qwen2.py").replace(
        model_name_or_path="google/gemma-4-E2B-it",
        reward_model_path="Skywork/Skywork-Reward-V2-Qwen3-1.7B",
        output_dir="gemma-4-E2B-it-Online-DPO",
        frozen_param_dtype="bfloat16",
    )

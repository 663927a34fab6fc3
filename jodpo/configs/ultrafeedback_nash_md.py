"""TRL 1.12's Nash-MD quick start: Qwen2-0.5B-Instruct on UltraFeedback prompts (chat data), with the reward model
TRL's "Use a reward model" tip puts in place of the PairRM judge (trl-lib/Qwen2-0.5B-Reward, the policy's tokenizer)
and the example script's learning rate 5e-7 and warm-up ratio 0.1; the rest as ultrafeedback_qwen2.py (TRL's online
DPO settings: 8 prompts x 2 accumulation steps, 64 new tokens, missing_eos_penalty 1.0 as TRL's "Encourage EOS
token generation" tip). Each step samples one completion from the policy and one from the geometric mixture of
policy and reference (mixture_coef 0.5, TRL's default); docs/online_family.md."""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("ultrafeedback_qwen2.py").replace(
        method="nash_md",
        mixture_coef=0.5,  # a list is indexed by epoch, as TRL's
        beta=0.1,
        output_dir="Qwen2-0.5B-NashMD",
    )

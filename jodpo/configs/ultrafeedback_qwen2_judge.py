"""TRL's Online DPO quick start, judged on the device: ultrafeedback_qwen2.py (Qwen2-0.5B-Instruct on UltraFeedback
prompts, chat data) with each pair of completions judged by an LLM where TRL's example calls PairRMJudge:
Qwen2.5-1.5B-Instruct with TRL's default pairwise prompt, read from the logits of its answers "0" and "1", both
orders averaged. The paper behind online DPO (Guo et al. 2024) uses an LLM annotator the same way.

A judge gives no scores, so the reward model, its EOS penalty (TRL applies it to rewards only) and the evaluation
go: trl-lib/ultrafeedback-prompt has no reference completions to judge the policy against."""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("ultrafeedback_qwen2.py").replace(
        reward_model_path=None,
        missing_eos_penalty=None,
        eval_strategy="no",
        judge="Qwen/Qwen2.5-1.5B-Instruct",  # or 'my_module:MyJudge' (TRL's BasePairwiseJudge.judge shape)
        judge_both_orders=True,  # two rows of the judge's forward per pair: position bias averaged out
        output_dir="Qwen2-0.5B-Online-DPO-LLM-judge",
    )

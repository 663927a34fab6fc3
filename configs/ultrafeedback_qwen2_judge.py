"""TRL's Online DPO quick start, judged on the device: Qwen2-0.5B-Instruct on UltraFeedback prompts (chat data), each
pair of completions judged by an LLM (Qwen2.5-1.5B-Instruct with TRL's default pairwise prompt, read from the logits
of its answers "0" and "1", both orders averaged) where TRL's example calls PairRMJudge. The paper behind online DPO
(Guo et al. 2024) uses an LLM annotator the same way."""
from jodpo.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model_name_or_path="Qwen/Qwen2-0.5B-Instruct",
        judge="Qwen/Qwen2.5-1.5B-Instruct",  # or 'my_module:MyJudge' (TRL's BasePairwiseJudge.judge shape)
        judge_both_orders=True,  # two forwards of the judge per pair: position bias averaged out
        dataset_name="trl-lib/ultrafeedback-prompt",
        output_dir="Qwen2-0.5B-Online-DPO-LLM-judge",
        learning_rate=5.0e-7,
        warmup_ratio=0.1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_new_tokens=64,
        save_total_limit=2,  # 12 bytes a policy parameter each (float32 weights + Adam): about 6 GB for 0.5B
    )

"""open-instruct's online DPO on TL;DR (its documentation's "LEVEL 1: 8 GPU; TL;DR summarization" command), field by
field. Each line names the open-instruct flag it reproduces; docs/open_instruct.md maps every flag.

Not needed in jodpo: --vllm_device cuda:7 (jodpo samples with its own sampler on the training devices; the
asynchronous generation it gave open-instruct is async_mode), --local_rollout_forward_batch_size 32 (the reference
and reward forwards of a micro-batch run in one jitted call), --with_tracking / --hf_metadata_dataset /
--no_try_launch_beaker_eval_jobs (metrics.jsonl and tensorboard/ in output_dir), accelerate with DeepSpeed ZeRO-3
on 7 processes (the default mesh splits parameters, gradients and optimizer state over every device). --push_to_hub
is jodpo's push_to_hub (TRL's field), left off here.

The dataset has prompt/chosen/rejected columns; with a reward model jodpo trains online DPO on its prompts (the
`prompt` text, as open-instruct's simple_concat_with_space template renders it), as open-instruct does."""
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        dataset_mixer={"trl-internal-testing/tldr-preference-sft-trl-style": 1.0},  # --dataset_mixer
        dataset_train_split="train",  # --dataset_train_splits train
        dataset_eval_mixer={"trl-internal-testing/tldr-preference-sft-trl-style": 1.0},  # --dataset_eval_mixer
        dataset_test_split="validation",  # --dataset_eval_splits validation
        max_length=1024,  # --max_token_length 1024
        max_prompt_length=512,  # --max_prompt_token_length 512
        learning_rate=3e-6,  # --learning_rate 3e-6
        output_dir="models/minimal/online_dpo_vllm_thread_tldr",  # --output_dir
        per_device_train_batch_size=16,  # --per_device_train_batch_size 16 (x 7 training GPUs there)
        gradient_accumulation_steps=4,  # --gradient_accumulation_steps 4
        num_epochs=1,  # --num_epochs 1
        num_mini_batches=1,  # --num_mini_batches 1
        total_episodes=1_000_000,  # --total_episodes 1000000
        model_name_or_path="cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr",  # --model_name_or_path
        reward_model_path="cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr",  # --reward_model_path
        non_eos_penalty=True,  # --non_stop_penalty
        penalty_reward_value=-1.0,  # open-instruct's default penalty_reward_value
        stop_token="eos",  # --stop_token eos
        beta=0.1,  # --beta 0.1
        max_new_tokens=53,  # --response_length 53
        async_mode=True,  # --vllm_device cuda:7: open-instruct generates one step behind, asynchronously
        temperature=0.7,  # open-instruct's default sampling temperature
        temperature_scaled_logprobs=True,  # open-instruct's loss forward divides the logits by it
        eval_strategy="steps",  # on dataset_eval_mixer; open-instruct's --num_evals N is eval_steps = 1 / N of the run:
        eval_steps=0.25,  # four evaluations, the last at the end
        save_total_limit=2,  # 12 bytes a parameter each (float32 weights + AdamW): about 12 GB for 1B
    )

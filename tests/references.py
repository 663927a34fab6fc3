"""Reference computations in the libraries jodpo is compared with (TRL, transformers, peft), shared by the test
files that compare against them."""
from pathlib import Path

import jax
import numpy as np
import optax
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import jodpo
from jodpo import judges as J
from jodpo import losses, scoring, train_step
from jodpo.program import rewards


def record_trl_step(paths, loss_type, use_rm, tmp_path, extra_eos=tuple(range(100, 140))):
    """TRL 1.16's first OnlineDPOTrainer step on the checkpoint ``paths["causal_lm"]`` (``paths["reward"]`` scoring
    with ``use_rm``, else ``length_reward``): its samples, log-probs, rewards, loss, logs and updated policy."""
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tok = AutoTokenizer.from_pretrained(paths["causal_lm"])
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(paths["causal_lm"], dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(paths["causal_lm"], dtype=torch.float32, attn_implementation="eager")
    # Extra EOS ids, so that some completions end early and some do not (both penalty branches run).
    policy.generation_config.eos_token_id = [tok.eos_token_id] + list(extra_eos)
    if use_rm:
        reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], dtype=torch.float32,
                                                                    attn_implementation="eager")
        extra = dict(reward_funcs=reward, reward_processing_classes=tok)
    else:
        extra = dict(reward_funcs=length_reward)
    args = OnlineDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, max_new_tokens=8,
                           beta=0.1, loss_type=loss_type, missing_eos_penalty=1.0, logging_steps=1, report_to=[],
                           save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
                           learning_rate=1e-3)
    trainer = OnlineDPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **extra)
    rec = {}
    gen, fwd, rew, step = trainer._generate, trainer._forward, trainer._calculate_rewards_from_functions, trainer.training_step

    def generate(*a, **k):
        out = gen(*a, **k)
        rec["prompt_ids"], rec["prompt_mask"], rec["completion_ids"], rec["completion_mask"] = (
            x.numpy().copy() for x in out[:4])
        return out

    def forward(model, *a, **k):
        out = fwd(model, *a, **k)
        rec.setdefault("logprobs", []).append(out.detach().numpy().copy())
        return out

    def calc_rewards(prompts, completions, completion_ids_list, **k):
        out = rew(prompts, completions, completion_ids_list, **k)
        rec["rewards"], rec["texts"] = out.numpy().copy(), (list(prompts), list(completions))
        return out

    def training_step(*a, **k):
        out = step(*a, **k)
        rec["loss"] = float(out)
        return out

    trainer._generate, trainer._forward = generate, forward
    trainer._calculate_rewards_from_functions, trainer.training_step = calc_rewards, training_step
    trainer.train()
    rec["log"] = trainer.state.log_history[0]
    trainer.model.save_pretrained(tmp_path / "after")  # the policy after TRL's optimizer step
    rec["eos_token_ids"] = trainer.eos_token_ids
    return rec


def check_step_equals_trl(paths, rec, loss_type, use_rm, tmp_path, scale: float = 1.0):
    """jodpo replays TRL's recorded step: log-probs, rewards, loss, gradient norm, metrics, updated parameters.
    ``scale`` widens the tolerances of what jodpo computes against torch (10 for a 30-layer real model, whose float32
    sums in another order drift further than a 2-layer fixture's: the 1e-4 the real-weight logits are held to)."""
    t = 1e-5 * scale
    model, params = jodpo.load_model(str(paths["causal_lm"]))
    P, C, cm = rec["prompt_ids"], rec["completion_ids"], rec["completion_mask"]
    assert 0 < scoring.contains_eos(C, cm, rec["eos_token_ids"]).sum() < len(C), "want rows with and without EOS"

    # Per-token log-probs (TRL's are unmasked; compare where the completion is real).
    lp = np.asarray(losses.completion_logprobs(model, params, P, rec["prompt_mask"], C, cm))
    trl_lp, trl_ref = rec["logprobs"]
    np.testing.assert_allclose(lp[cm > 0], trl_lp[cm > 0], rtol=t, atol=t)
    np.testing.assert_allclose(trl_ref, trl_lp, rtol=1e-6)  # before the update, the reference is the policy

    # Rewards: jodpo's own scoring of TRL's texts (re-tokenized with the reward tokenizer) matches.
    if use_rm:
        rm, rm_params = jodpo.load_model(str(paths["reward"]), task="reward")
        tok = jodpo.load_tokenizer(str(paths["causal_lm"]))
        ours = rewards.score_texts(rm, rm_params, tok, *rec["texts"])
    else:
        ours = rewards.call_reward_functions([length_reward], *rec["texts"], completion_ids=None)
    # relative to the largest reward: a reward near 0 is a difference of terms of the largest's size (Qwen3.5's
    # delta rule, a triangular solve per chunk, rounds at a few 1e-6 of that scale in float32)
    np.testing.assert_allclose(ours, rec["rewards"], rtol=t, atol=t * np.abs(rec["rewards"]).max())

    def loss_fn(p, ref):
        return losses.online_dpo_loss(model, p, ref, P, rec["prompt_mask"], C, cm, rec["rewards"], beta=0.1,
                                      loss_type=loss_type, missing_eos_penalty=1.0,
                                      eos_token_ids=rec["eos_token_ids"])

    # jitted, as a run computes it (op by op, the 30-layer model's gradient took 12 s of dispatching and compiling)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, params)
    log = rec["log"]
    np.testing.assert_allclose(float(loss), rec["loss"], rtol=t, atol=1e-2 * t)
    np.testing.assert_allclose(float(jax.jit(optax.global_norm)(grads)), log["grad_norm"], rtol=t, atol=1e-2 * t)
    same = ["objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "logps/chosen", "logps/rejected", "val/contain_eos_token", "beta"]
    for k in same:
        np.testing.assert_allclose(float(metrics[k]), log[k], rtol=t, atol=0.1 * t, err_msg=k)
    # rewards/accuracies is mean(margin > 0) per pair. At TRL's first step the policy is the reference, so every
    # margin is 0 up to float rounding (TRL's exactly, jodpo's +-1e-9, on some CPUs): it is compared only when
    # every pair's margin is clear of 0 by more than the tolerance above (rewards/margins checks the values).
    chosen, rejected = (np.asarray(i) for i in scoring.pair_indices(scoring.apply_eos_penalty(
        rec["rewards"], scoring.contains_eos(C, cm, rec["eos_token_ids"]), 1.0, None)))
    ratio = ((trl_lp - trl_ref) * cm).sum(1)
    trl_margins = 0.1 * (ratio[chosen] - ratio[rejected])
    if np.all(np.abs(trl_margins) > t):
        assert float(metrics["rewards/accuracies"]) == log["rewards/accuracies"] == np.mean(trl_margins > 0)
    # Deliberate difference: TRL 1.16 sums KL/entropy over padding; jodpo masks. Check both readings.
    kl_trl = (trl_lp - trl_ref).sum(1).mean()
    np.testing.assert_allclose(log["objective/kl"], kl_trl, atol=1e-6)
    np.testing.assert_allclose(float(metrics["objective/kl"]), ((trl_lp - trl_ref) * cm).sum(1).mean(), atol=t)
    np.testing.assert_allclose(log["objective/entropy"], -trl_lp.sum(1).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["objective/entropy"]), -(trl_lp * cm).sum(1).mean(), rtol=t)

    # The whole update (clip, AdamW, schedule): jodpo's step from the same samples lands on TRL's parameters.
    B = len(PROMPTS)
    np.testing.assert_array_equal(P[:B], P[B:])  # TRL repeats the prompts: block layout
    cfg = train_step.StepConfig(
        model=model, sampling=jodpo.SamplingConfig(eos_token_ids=rec["eos_token_ids"], pad_token_id=model.pad_token_id),
        optimizer=train_step.OptimizerConfig(learning_rate=1e-3, total_steps=1), beta=0.1, loss_type=loss_type,
        missing_eos_penalty=1.0)
    samples = jodpo.Samples(tokens=C[None], mask=cm[None], logprobs=np.zeros(C.shape, np.float32)[None])
    state, step_metrics = train_step.jit_update(cfg, train_step.init_state(cfg, params, jax.random.key(0)), params,
                                                P[None, :B], rec["prompt_mask"][None, :B], samples, rec["rewards"][None])
    np.testing.assert_allclose(float(step_metrics["grad_norm"]), log["grad_norm"], rtol=t)
    _, trl_after = jodpo.load_model(str(tmp_path / "after"))
    moved = 0
    for (path, ours), theirs, before, g in zip(jax.tree.leaves_with_path(state.params), jax.tree.leaves(trl_after),
                                               jax.tree.leaves(params), jax.tree.leaves(grads)):
        # Adam's first step is lr * g / (|g| + eps): on an entry whose gradient is float noise (for example the key
        # bias, whose gradient is exactly zero in exact arithmetic) both sides move by lr * noise/|noise|, so
        # compare the entries with a real gradient (well above float noise and Adam's eps).
        real = np.abs(np.asarray(g)) * min(1.0, 1.0 / log["grad_norm"]) > 0.1 * t  # after clipping, above eps and noise
        np.testing.assert_allclose(np.asarray(ours)[real], np.asarray(theirs)[real], atol=0.2 * t, rtol=0,
                                   err_msg=str(path))
        moved += int(np.sum(np.abs(np.asarray(theirs) - np.asarray(before))[real] > 5e-4))
    assert moved > 1000  # the step really moved the parameters (by about lr each)


def transformers_p_first(path, texts):
    """P("0") / (P("0") + P("1")) at the end of each text, by transformers (float32, one row at a time)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    zero, one = (tok(a, add_special_tokens=False)["input_ids"][0] for a in ("0", "1"))
    out = []
    for text in texts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            last = hf(ids).logits[0, -1].double()
        out.append(torch.softmax(last[[zero, one]], -1)[0].item())
    return np.array(out)


def reference_text(tokenizer, prompt, a, b):
    """The judge's input written out by hand: TRL's prompt as the user's message, in the judge's chat template."""
    as_text = lambda x: x if isinstance(x, str) else "".join(  # noqa: E731
        f"{m['role'].capitalize()}: {m['content']}\n\n" for m in x)
    content = J.DEFAULT_PAIRWISE_PROMPT.format(prompt=as_text(prompt), response0=as_text(a), response1=as_text(b))
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def peft_logits(path, adapter_dir, ids, mask):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


PROMPTS = ["the quick brown fox", "hello world, hello", "TL;DR: a short", "online dpo samples two"]


def length_reward(prompts, completions, completion_ids, **kw):
    # A callable reward with a None (ignored by the weighted nansum) in the mix.
    return [None if i == 1 else float(len(c)) / 10 for i, c in enumerate(completions)]


def check_language_model_of_multimodal(hf, model, params, out: Path, architecture: str, tol: float) -> None:
    """jodpo's language model of the ``*ForConditionalGeneration`` ``hf`` (``model``, ``params``): its logits on text
    (left-padded) equal the multimodal model's, and its export to ``out`` is an ``architecture`` that transformers
    reads back to the same logits (``tol`` of the largest logit)."""
    import json

    from tests import hf_fixtures

    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(6), [9, 4], model.pad_token_id, "left", high=200)
    inputs = dict(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0), dtype=torch.long))
    ours = np.asarray(jodpo.logits(model, params, ids, mask))
    with torch.no_grad():
        ref = hf(**inputs).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], rtol=tol, atol=tol * np.abs(ref[real]).max())
    saved = jodpo.save_hf(model, params, out)
    assert json.loads((saved / "config.json").read_text())["architectures"] == [architecture]
    with torch.no_grad():
        back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="eager").eval()(
            **inputs).logits.numpy()
    np.testing.assert_allclose(back[real], ref[real], rtol=tol, atol=tol * np.abs(ref[real]).max())

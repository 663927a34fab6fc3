"""A real TRL 1.16 OnlineDPOTrainer step, recorded, then replayed through jodpo with the same tokens: the
log-probs, rewards, loss, gradient norm, metrics, and the parameters after the AdamW update.

Deliberate differences, stated where checked: jodpo masks KL and entropy to the completion (TRL 1.16
sums them over padding too)."""
import jax
import numpy as np
import optax
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import jodpo
from jodpo import losses, rewards, train_step

PROMPTS = ["the quick brown fox", "hello world, hello", "TL;DR: a short", "online dpo samples two"]


def _length_reward(prompts, completions, completion_ids, **kw):
    # A callable reward with a None (ignored by the weighted nansum) in the mix.
    return [None if i == 1 else float(len(c)) / 10 for i, c in enumerate(completions)]


def record_trl_step(paths, loss_type, use_rm, tmp_path, extra_eos=tuple(range(100, 140))):
    """TRL 1.16's first OnlineDPOTrainer step on the checkpoint ``paths["causal_lm"]`` (``paths["reward"]`` scoring
    with ``use_rm``, else ``_length_reward``): its samples, log-probs, rewards, loss, logs and updated policy."""
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
        extra = dict(reward_funcs=_length_reward)
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


@pytest.mark.parametrize("family,loss_type,use_rm", [("neox", "sigmoid", True), ("llama", "ipo", True),
                                                     ("neox", "ipo", False), ("llama", "sigmoid", False)])
def test_one_step_equals_trl(checkpoints, tmp_path, family, loss_type, use_rm):
    paths = checkpoints[family]
    check_step_equals_trl(paths, record_trl_step(paths, loss_type, use_rm, tmp_path), loss_type, use_rm, tmp_path)


def check_step_equals_trl(paths, rec, loss_type, use_rm, tmp_path, scale: float = 1.0):
    """jodpo replays TRL's recorded step: log-probs, rewards, loss, gradient norm, metrics, updated parameters.
    ``scale`` widens the tolerances of what jodpo computes against torch (10 for a 30-layer real model, whose float32
    sums in another order drift further than a 2-layer fixture's: the 1e-4 the real-weight logits are held to)."""
    t = 1e-5 * scale
    model, params = jodpo.load_model(str(paths["causal_lm"]))
    P, C, cm = rec["prompt_ids"], rec["completion_ids"], rec["completion_mask"]
    assert 0 < rewards.contains_eos(C, cm, rec["eos_token_ids"]).sum() < len(C), "want rows with and without EOS"

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
        ours = rewards.call_reward_functions([_length_reward], *rec["texts"], completion_ids=None)
    np.testing.assert_allclose(ours, rec["rewards"], rtol=1e-5, atol=1e-6)

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
    chosen, rejected = (np.asarray(i) for i in rewards.pair_indices(rewards.apply_eos_penalty(
        rec["rewards"], rewards.contains_eos(C, cm, rec["eos_token_ids"]), 1.0, None)))
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


# --------------------------------------------------------------------------------------------------
# Offline: SimPO against TRL's CPOTrainer, LD-DPO against TRL's DPOTrainer
# --------------------------------------------------------------------------------------------------

PREFS = [("the quick brown fox", " jumps over the lazy dog", " hello"),
         ("TL;DR: a short", " summary of the post, a short one", " summary"),
         ("hello world,", " hello jax", " online dpo samples two completions per prompt"),
         ("online dpo", " prefers the higher reward", " the")]


def _pad(rows, pad, side):
    rows = [list(r) for r in rows]
    L = max(map(len, rows))
    ids, mask = np.full((len(rows), L), pad, np.int32), np.zeros((len(rows), L), np.int32)
    for b, r in enumerate(rows):
        sl = slice(L - len(r), L) if side == "left" else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


def _responses(chosen, rejected, pad):
    """chosen and rejected ids right-padded to one width (dpo_loss's layout)."""
    ids, mask = _pad(list(chosen) + list(rejected), pad, "right")
    B = len(chosen)
    return ids[:B], mask[:B], ids[B:], mask[B:]


def _offline_batch(tok, pad):
    """prompt ids left-padded, chosen / rejected ids right-padded with their EOS, as jodpo.data prepares them."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc(p) for p, _, _ in PREFS]
    chosen = [enc(c) + [tok.eos_token_id] for _, c, _ in PREFS]
    rejected = [enc(r) + [tok.eos_token_id] for _, _, r in PREFS]
    return prompts, chosen, rejected, (*_pad(prompts, pad, "left"), *_responses(chosen, rejected, pad))


def test_simpo_offline_equals_trl_cpo(checkpoints):
    """TRL's CPOTrainer.cpo_loss (loss_type='simpo', with label smoothing) on the average log-probs its own
    get_batch_logps reads from the torch model's logits: the loss, rewards/*, logps/* and the gradient's norm."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    path = str(checkpoints["llama"]["causal_lm"])
    tok = AutoTokenizer.from_pretrained(path)
    model, params = jodpo.load_model(path)
    beta, gamma, eps = 2.0, 0.7, 0.1
    prompts, chosen, rejected, batch = _offline_batch(tok, model.pad_token_id)

    torch_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    rows = [p + c for p, c in zip(prompts, chosen)] + [p + r for p, r in zip(prompts, rejected)]
    labels_rows = [[-100] * len(p) + c for p, c in zip(prompts, chosen)] + \
                  [[-100] * len(p) + r for p, r in zip(prompts, rejected)]
    ids, mask = _pad(rows, model.pad_token_id, "right")
    labels = np.full(ids.shape, -100, np.int64)
    for b, r in enumerate(labels_rows):
        labels[b, :len(r)] = r
    logits = torch_model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    logps = CPOTrainer.get_batch_logps(logits, torch.tensor(labels), average_log_prob=True)
    B = len(PREFS)
    cpo = SimpleNamespace(alpha=0.0, accelerator=SimpleNamespace(device="cpu"), loss_type="simpo",
                          simpo_gamma=gamma, beta=beta, label_smoothing=eps)
    trl_losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, logps[:B], logps[B:])
    trl_loss = trl_losses.mean()
    trl_loss.backward()
    trl_grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in torch_model.parameters() if p.grad is not None))

    options = losses.LossOptions(label_smoothing=eps, simpo_gamma=gamma)
    (loss, m), grads = jax.jit(jax.value_and_grad(
        lambda p: losses.dpo_loss(model, p, None, *batch, beta=beta, loss_type="simpo", options=options),
        has_aux=True))(params)
    np.testing.assert_allclose(float(loss), trl_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(optax.global_norm(grads)), float(trl_grad_norm), rtol=1e-4)
    want = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": logps[:B].mean(), "logps/rejected": logps[B:].mean()}
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < float(m["rewards/accuracies"]) < 1  # both kinds of pairs: accuracies is a real check


def test_ld_dpo_offline_equals_trl_dpo_trainer(checkpoints, tmp_path):
    """TRL's DPOTrainer with ld_alpha (the loss and its logged metrics, from its own tokenization, collation and
    forwards), against jodpo's dpo_loss on the same token ids, the reference a perturbed copy of the policy (so that
    the log-ratios, and how their verbose tails are weighted, matter)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    path = str(checkpoints["llama"]["causal_lm"])
    tok = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(tmp_path / "ref")
    args = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PREFS), beta=0.5,
                     ld_alpha=0.3, report_to=[], use_cpu=True, bf16=False, max_length=None, seed=0)
    data = Dataset.from_dict({k: [row[i] for row in PREFS] for i, k in enumerate(("prompt", "chosen", "rejected"))})
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok, train_dataset=data)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    logged = {k: v[-1] for k, v in trainer._metrics["train" if trainer.model.training else "eval"].items()}

    rows = trainer.train_dataset
    pad = tok.pad_token_id
    batch = (*_pad(rows["prompt_ids"], pad, "left"), *_responses(rows["chosen_ids"], rows["rejected_ids"], pad))
    model, params = jodpo.load_model(path)
    _, ref_params = jodpo.load_model(str(tmp_path / "ref"))

    @jax.jit
    def ld_and_plain(params, ref_params, batch):
        ld = losses.dpo_loss(model, params, ref_params, *batch, beta=0.5, options=losses.LossOptions(ld_alpha=0.3))
        return ld, losses.dpo_loss(model, params, ref_params, *batch, beta=0.5)[0]

    (loss, m), plain = ld_and_plain(params, ref_params, batch)
    np.testing.assert_allclose(float(loss), trl_loss.item(), rtol=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
              "logps/rejected"):
        # rewards are beta x a difference of two sums of ~-100 (float32: ~1e-5 apart in the last bits)
        np.testing.assert_allclose(float(m[k]), logged[k], rtol=1e-5, atol=2e-5, err_msg=k)
    assert abs(float(plain) - float(loss)) > 1e-3  # the verbose tails' weight changed the loss

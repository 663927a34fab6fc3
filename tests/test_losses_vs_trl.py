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
from transformers import AutoModelForCausalLM, AutoTokenizer

import jodpo
from jodpo import losses
from tests import references


@pytest.mark.parametrize("family,loss_type,use_rm", [("neox", "sigmoid", True), ("llama", "ipo", True),
                                                     ("neox", "ipo", False), ("llama", "sigmoid", False),
                                                     ("qwen3", "sigmoid", True), ("qwen3_5", "sigmoid", True),
                                                     ("gemma3", "sigmoid", True), ("smollm3", "sigmoid", True),
                                                     ("olmo3", "sigmoid", True), ("gemma4", "sigmoid", True),
                                                     ("qwen3_moe", "sigmoid", True)])
def test_one_step_equals_trl(checkpoints, tmp_path, family, loss_type, use_rm):
    paths = checkpoints[family]
    # Gemma 4's float32 gradients are themselves 1-3e-5 (of the largest) from float64's, torch's and jodpo's alike (its
    # unscaled attention scores; measured): its gradient norm is held to 4e-5
    scale = 4.0 if family == "gemma4" else 1.0
    references.check_step_equals_trl(paths, references.record_trl_step(paths, loss_type, use_rm, tmp_path), loss_type,
                                     use_rm, tmp_path, scale=scale)


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
    """prompt ids left-padded, chosen / rejected ids right-padded with their EOS, as jodpo.program.data prepares them."""
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

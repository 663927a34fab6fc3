"""The pure training step: optimizer and schedule vs transformers, accumulation, beta lists, the fused and split
paths, offline DPO, no recompiles, NaN guard, and a short run that must raise a programmatic reward."""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import train_step as ts
from jodpo.losses import completion_logprobs, online_dpo_loss
from jodpo.models import lora
from jodpo.models.params import frozen_params
from tests import hf_fixtures
from tests import helpers


@pytest.mark.parametrize("name", ["linear", "cosine", "constant_with_warmup", "constant"])
def test_schedule_equals_transformers(name):
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
    sched = get_scheduler(name, opt, num_warmup_steps=3, num_training_steps=11)
    ours = ts.learning_rate_schedule(ts.OptimizerConfig(learning_rate=2e-5, total_steps=11, warmup_steps=3,
                                                        lr_scheduler_type=name))
    for s in range(12):
        np.testing.assert_allclose(float(ours(s)), sched.get_last_lr()[0], rtol=1e-6, atol=1e-12, err_msg=str(s))
        opt.step()
        sched.step()


def test_optimizer_equals_torch_adamw():
    import torch

    cfg = ts.OptimizerConfig(learning_rate=1e-2, total_steps=5, warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5)
    rng = np.random.default_rng(0)
    w0, grads = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(5, 4, 3)).astype(np.float32)
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / 1 if s < 1 else max(0.0, (5 - s) / 4))
    params = {"w": jnp.asarray(w0)}
    state = ts.TrainState(step=jnp.int32(0), params=params, opt_state=ts.make_optimizer(cfg).init(params),
                          rng=jax.random.key(0))
    # what apply_gradients reads of a StepConfig: the optimizer, and whether the model has buffers it never trains
    step_cfg = types.SimpleNamespace(optimizer=cfg, model=types.SimpleNamespace(layer_scalar=False))
    for g in grads:
        p.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_norm_(p, 0.5)
        opt.step()
        logged = opt.param_groups[0]["lr"]  # transformers' Trainer logs the rate before the scheduler's step
        sched.step()
        state, metrics = ts.apply_gradients(step_cfg, state, {"w": jnp.asarray(g)}, {"loss": jnp.float32(0)})
        assert float(metrics["learning_rate"]) == pytest.approx(logged, rel=1e-6, abs=1e-12)  # float32; 0 first (warm-up)
    np.testing.assert_allclose(np.asarray(state.params["w"]), p.detach().numpy(), rtol=1e-6, atol=1e-6)  # decay order


def test_beta_list_indexed_by_epoch(neox):
    model, _ = neox
    cfg = helpers.step_cfg(model, beta=[0.1, 0.2, 0.4], updates_per_epoch=3)
    got = [float(ts.current_beta(cfg, s)) for s in range(12)]
    np.testing.assert_allclose(got, [0.1] * 3 + [0.2] * 3 + [0.4] * 6, rtol=1e-7)
    with pytest.raises(ValueError, match="beta"):
        helpers.step_cfg(model, beta=[0.1, -1.0])
    with pytest.raises(ValueError, match="unknown loss_type"):
        helpers.step_cfg(model, loss_type="dpo")


def test_accumulation_averages_micro_batches(neox):
    """Two micro-batches of 2 prompts give the gradient of one batch of 4 (TRL would double it)."""
    model, params = neox
    cfg = helpers.step_cfg(model, opt={"max_grad_norm": 0.0})
    ids, mask = helpers.prompt_batch(model, 2, 2)
    state = ts.init_state(cfg, params, jax.random.key(0))
    samples = ts.jit_sample_completions(cfg, state, ids, mask)
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)), jnp.float32)
    _, m2 = ts.jit_update(cfg, ts.init_state(cfg, params, jax.random.key(0)), params, ids, mask, samples, rewards)

    # The same rows as one micro-batch of 4 prompts, block layout rebuilt: [c0 of all 4, c1 of all 4].
    def merge(x):  # [2, 2B, ...] -> [1, 4B, ...]
        return jnp.concatenate([x[0, :2], x[1, :2], x[0, 2:], x[1, 2:]])[None]

    one = jax.tree.map(merge, samples)
    _, m1 = ts.jit_update(cfg, ts.init_state(cfg, params, jax.random.key(0)), params, ids.reshape(1, 4, -1),
                          mask.reshape(1, 4, -1), one, merge(rewards))
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)


def test_fused_step_equals_split_path_and_does_not_recompile(checkpoints, neox):
    model, params = neox
    rm, rm_params = jodpo.load_model(str(checkpoints["neox"]["reward"]), task="reward")
    cfg = helpers.step_cfg(model, reward_model=rm, missing_eos_penalty=1.0)
    ids, mask = helpers.prompt_batch(model, 2, 2)
    # Split: sample, score, update as three calls.
    state = ts.init_state(cfg, params, jax.random.key(3))
    samples = ts.jit_sample_completions(cfg, state, ids, mask)
    rewards = ts.jit_score_completions(cfg, rm_params, ids, mask, samples)
    split_state, split_metrics = ts.jit_update(cfg, state, params, ids, mask, samples, rewards)
    # Fused, twice (the second step must reuse the compiled function).
    fused = ts.init_state(cfg, params, jax.random.key(3))
    fused, metrics, fused_samples, fused_rewards = ts.jit_online_step(cfg, fused, params, rm_params, ids, mask)
    np.testing.assert_array_equal(np.asarray(fused_samples.tokens), np.asarray(samples.tokens))
    # a score is a dot product over the hidden size whose partial sums are of the batch's scale: the two programs
    # (fused differently) may reassociate it, so a small score differs by float32 ulps of the largest, not of its own
    scale = float(np.abs(np.asarray(rewards)).max())
    np.testing.assert_allclose(np.asarray(fused_rewards), np.asarray(rewards), rtol=1e-6,
                               atol=16 * np.finfo(np.float32).eps * scale)
    # objective/kl is a difference of log-prob sums (policy minus reference, about 0 here): float32 noise of those
    # sums' size, a few ulps of |logps|, is what the two paths may differ by there
    atol = 8 * np.finfo(np.float32).eps * abs(float(split_metrics["logps/chosen"]))
    for k in split_metrics:
        if k == "rewards/accuracies":  # the policy is its own reference: every margin is float noise about 0, its
            continue  # sign the two programs' rounding
        np.testing.assert_allclose(float(metrics[k]), float(split_metrics[k]), rtol=1e-5, atol=atol, err_msg=k)
    assert "rollout/slot_utilization" in metrics and "rollout/generated_tokens" in metrics
    assert float(metrics["rollout/generated_tokens"]) == float(np.asarray(samples.mask).sum())
    # the same update from gradients the two programs round differently (their fusions differ): Adam's first step
    # turns a gradient entry that is float noise into up to +-lr, so helpers.close_params' bound, not a float32 tolerance
    helpers.close_params(fused.params, split_state.params, 1e-3, 1)
    assert int(fused.step) == 1 and float(metrics["learning_rate"]) == pytest.approx(1e-3)  # the first update's: no warm-up
    compiled = ts.jit_online_step._cache_size()
    fused, metrics, _, _ = ts.jit_online_step(cfg, fused, params, rm_params, ids, mask)
    assert int(fused.step) == 2 and ts.jit_online_step._cache_size() == compiled
    # The reward metrics are the reward model's (after the EOS penalty), computed in the step.
    assert np.isfinite(float(metrics["objective/scores"]))


def test_a_window_is_sampled_in_one_call_in_block_layout(neox):
    """The A micro-batches of a window sampled together give, greedily, each micro-batch's own two-sample block
    layout: rows [0, B) completion 0 of its prompts, [B, 2B) completion 1."""
    model, params = neox
    cfg = helpers.step_cfg(model)
    cfg = ts.StepConfig(model=model, sampling=dataclasses.replace(cfg.sampling, temperature=0.0),
                        optimizer=cfg.optimizer)
    ids, mask = helpers.prompt_batch(model, 3, 2, seed=8)
    got = ts.jit_sample_completions(cfg, ts.init_state(cfg, params, jax.random.key(0)), ids, mask)
    assert got.tokens.shape == (3, 4, 6)
    for a in range(3):
        ref = jodpo.sample(model, params, ids[a], mask[a], jax.random.key(1), cfg.sampling, num_samples=2)
        np.testing.assert_array_equal(np.asarray(got.tokens[a]), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(got.mask[a]), np.asarray(ref.mask))
        np.testing.assert_allclose(np.asarray(got.logprobs[a]), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-6)


def test_a_window_sampled_a_few_prompts_at_a_time_is_the_same_window(neox):
    """``SamplingConfig.slots`` below a window's prompts (``sampler_slots``: a window larger than the rows whose
    caches fit): the completions of the window's prompts sampled a few at a time (in the window's prompt-major order,
    each batch drawing as its place in it), in the window's layout, and the step's metrics say how much of the decode
    loop's row-steps held real tokens."""
    model, params = neox
    cfg = helpers.step_cfg(model)
    A, B, S = 3, 2, 2
    ids, mask = helpers.prompt_batch(model, A, B, seed=9)
    state = ts.init_state(cfg, params, jax.random.key(0))
    few = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, slots=S))
    got = ts.jit_sample_completions(few, state, ids, mask)
    flat = lambda x: x.transpose(1, 0, 2).reshape(A * B, -1)  # noqa: E731 (prompt b * A + a)
    key = jax.random.fold_in(state.rng, state.step)
    parts = [jodpo.sample(model, params, flat(ids)[i:i + S], flat(mask)[i:i + S], key, cfg.sampling, 2, i)
             for i in range(0, A * B, S)]
    T = cfg.sampling.max_new_tokens
    for name in ("tokens", "mask"):
        rows = np.concatenate([np.asarray(getattr(o, name)).reshape(2, S, T) for o in parts], 1)  # [k, b * A + a]
        want = rows.reshape(2, B, A, T).transpose(2, 0, 1, 3).reshape(A, 2 * B, T)
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), want)
    made = float(np.asarray(got.mask).sum() - np.asarray(got.mask)[..., 0].sum())
    metrics = ts.rollout_metrics(few, ids, got)
    assert float(metrics["rollout/slot_utilization"]) == pytest.approx(made / (int(got.decode_steps.max()) * 2 * S))
    assert float(metrics["rollout/generated_tokens"]) == float(np.asarray(got.mask).sum())


def test_non_finite_loss_skips_the_update(neox):
    model, params = neox
    cfg = helpers.step_cfg(model)
    ids, mask = helpers.prompt_batch(model, 1, 2)
    state = ts.init_state(cfg, params, jax.random.key(0))
    samples = ts.jit_sample_completions(cfg, state, ids, mask)
    rewards = jnp.asarray([[0.0, 1.0, 2.0, 0.5]])
    bad = jax.tree.map(lambda x: x.at[..., 0].set(jnp.nan) if x.ndim == 2 else x, params)  # NaN embeddings/head
    before = jax.tree.map(np.asarray, bad)
    state, metrics = ts.jit_update(cfg, ts.init_state(cfg, bad, jax.random.key(0)), params, ids, mask, samples,
                                   rewards)
    assert float(metrics["skipped_update"]) == 1.0 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_offline_step_matches_the_online_loss_with_fixed_pairs(neox):
    """Offline DPO is the online loss with the pairs taken from the data (rewards 1 for chosen, 0 rejected)."""
    model, params = neox
    cfg = helpers.step_cfg(model, loss_type="ipo", beta=0.5)
    ids, mask = helpers.prompt_batch(model, 1, 3)
    rng = np.random.default_rng(4)
    chosen, cmask = hf_fixtures.padded_batch(rng, [3, 5, 2], model.pad_token_id, "right")
    rejected, rmask = hf_fixtures.padded_batch(rng, [4, 1, 5], model.pad_token_id, "right")
    C = 5
    pad = lambda x: np.pad(x, ((0, 0), (0, C - x.shape[1])))
    batch = ts.PreferenceBatch(ids, mask, pad(chosen)[None], pad(cmask)[None], rejected[None], rmask[None])
    _, metrics = ts.jit_offline_step(cfg, ts.init_state(cfg, params, jax.random.key(0)),
                                     params, batch)
    moved = jax.tree.map(lambda x: x + 0.01, params)  # a policy that differs from the reference
    _, off = ts.jit_offline_step(cfg, ts.init_state(cfg, moved, jax.random.key(0)), params, batch)
    on_loss, on = online_dpo_loss(model, jax.tree.map(lambda x: x + 0.01, params), params, ids[0], mask[0],
                                  np.concatenate([pad(chosen), rejected]), np.concatenate([pad(cmask), rmask]),
                                  np.array([1.0] * 3 + [0.0] * 3), beta=0.5, loss_type="ipo")
    np.testing.assert_allclose(float(off["loss"]), float(on_loss), rtol=1e-5)
    for k in ("logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(float(off[k]), float(on[k]), rtol=1e-5, err_msg=k)
    # rewards are beta x (S - S_ref), a difference of summed log-probs of size |S|: float32 rounding of the two
    # forwards (one jitted step, one eager loss) is relative to |S|, not to the difference.
    atol = 1e-5 * 0.5 * (abs(float(on["logps/chosen"])) + abs(float(on["logps/rejected"])))
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        np.testing.assert_allclose(float(off[k]), float(on[k]), rtol=0, atol=atol, err_msg=k)
    # accuracies threshold each pair's margin at 0: compare them where every margin is clear of the rounding
    comps, cmasks = np.concatenate([pad(chosen), rejected]), np.concatenate([pad(cmask), rmask])
    ratio = (completion_logprobs(model, moved, ids[0], mask[0], comps, cmasks)
             - completion_logprobs(model, params, ids[0], mask[0], comps, cmasks)).sum(-1)
    margins = 0.5 * np.asarray(ratio[:3] - ratio[3:])
    if np.all(np.abs(margins) > 10 * atol):
        assert float(off["rewards/accuracies"]) == float(on["rewards/accuracies"]) == np.float32(np.mean(margins > 0))
    assert float(metrics["loss"]) == pytest.approx(1.0, rel=1e-5)  # policy == reference: (0 - 1/(2*0.5))^2


def _run(model, params, sign: float, steps: int = 30):
    """``steps`` online steps with a host reward: the fraction of completion tokens with an even id."""
    cfg = helpers.step_cfg(model, beta=0.1, opt={"learning_rate": 1e-2, "total_steps": steps})
    ids, mask = helpers.prompt_batch(model, 1, 8, seed=5)
    state = ts.init_state(cfg, params, jax.random.key(0))
    scores = []
    for _ in range(steps):
        samples = ts.jit_sample_completions(cfg, state, ids, mask)
        tok, m = np.asarray(samples.tokens), np.asarray(samples.mask)
        reward = ((tok % 2 == 0) * m).sum(-1) / np.maximum(m.sum(-1), 1)
        scores.append(reward.mean())
        state, _ = ts.jit_update(cfg, state, params, ids, mask, samples, jnp.asarray(sign * reward, jnp.float32))
    return np.mean(scores[:5]), np.mean(scores[-5:])


def test_thirty_steps_raise_a_programmatic_reward(neox):
    model, params = neox
    first, last = _run(model, params, +1.0)
    assert last > first + 0.25, (first, last)
    # The same run rewarding the opposite: the score must fall (a flipped gradient sign fails one of the two).
    first, last = _run(model, params, -1.0)
    assert last < first - 0.25, (first, last)


def test_stop_token_truncates_like_open_instruct_and_alone_spares_the_penalty(neox, tokenizer_dir):
    """open-instruct's stop_token: sampling that also stops at a stop id equals sampling without it then
    ``truncate_response`` (keep up to the first stop id, pad after), written as a Python loop; the penalty and
    val/contain_eos_token then look for the stop id alone."""
    from jodpo.program.config import TrainConfig
    from jodpo.program.run import stop_token_ids

    model, params = neox
    cfg = helpers.step_cfg(model)
    ids, mask = helpers.prompt_batch(model, 1, 4, seed=2)
    state = ts.init_state(cfg, params, jax.random.key(5))
    free = ts.jit_sample_completions(cfg, state, ids, mask)
    tokens, tmask = np.asarray(free.tokens[0]), np.asarray(free.mask[0])
    stop = int(tokens[0, 2])  # a token the sampler draws mid-completion, as the stop token
    eos = cfg.sampling.eos_token_ids
    stopped_cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, eos_token_ids=(*eos, stop)),
                                      stop_token_ids=(stop,))
    got = ts.jit_sample_completions(stopped_cfg, state, ids, mask)
    want_t, want_m = tokens.copy(), tmask.copy()
    for r in range(len(want_t)):
        for t in range(want_t.shape[1]):
            if want_m[r, t] and want_t[r, t] == stop:
                want_t[r, t + 1:], want_m[r, t + 1:] = model.pad_token_id, 0
                break
    np.testing.assert_array_equal(np.asarray(got.tokens[0]), want_t)
    np.testing.assert_array_equal(np.asarray(got.mask[0]), want_m)
    # the penalty: a reward of 0 for all, and missing_eos_penalty 1 for completions without the stop id
    penalised = dataclasses.replace(stopped_cfg, missing_eos_penalty=1.0)
    _, metrics = ts.jit_update(penalised, state, params, ids, mask, got, jnp.zeros((1, 8)))
    has_stop = ((want_t == stop) & (want_m > 0)).any(-1)
    assert 0 < has_stop.mean() < 1
    assert float(metrics["val/contain_eos_token"]) == pytest.approx(has_stop.mean())
    assert float(metrics["objective/scores"]) == pytest.approx(-(1 - has_stop.mean()))
    tok = jodpo.load_tokenizer(str(tokenizer_dir))
    assert stop_token_ids(TrainConfig(stop_token="period"), tok) == tuple(tok.encode(".", add_special_tokens=False))
    assert stop_token_ids(TrainConfig(stop_token="eos"), tok) == ()


def test_rollout_update_equals_a_python_loop_over_epochs_and_mini_batches(neox):
    """open-instruct's num_epochs x num_mini_batches updates per rollout, against plain loops: each epoch shuffles
    the rollout's pairs, each mini-batch of A micro-batches is one ``update``; the reference log-probs are fixed."""
    model, params = neox
    cfg = helpers.step_cfg(model)
    R, B, E, M = 4, 2, 2, 2
    A = R // M
    ids, mask = helpers.prompt_batch(model, R, B, seed=3)
    state = ts.init_state(cfg, params, jax.random.key(7))
    samples = ts.jit_sample_completions(cfg, state, ids, mask)
    rewards = np.random.default_rng(0).normal(size=(R, 2 * B)).astype(np.float32)
    got, metrics = ts.jit_rollout_update(cfg, ts.init_state(cfg, params, jax.random.key(7)), params, ids, mask,
                                         samples, rewards, E, M)
    assert int(got.step) == E * M and np.isfinite(float(metrics["loss"]))
    tokens, tmask, logprobs = (np.asarray(x) for x in (samples.tokens, samples.mask, samples.logprobs))
    pairs = [(ids[r, b], mask[r, b], [x[r, [b, B + b]] for x in (tokens, tmask, logprobs)], rewards[r, [b, B + b]])
             for r in range(R) for b in range(B)]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 0x5EED), 0)
    want = ts.init_state(cfg, params, jax.random.key(7))
    for epoch in range(E):
        order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), R * B))
        for m in range(M):
            chosen = [pairs[i] for i in order[m * A * B:(m + 1) * A * B]]
            mbs = [chosen[a * B:(a + 1) * B] for a in range(A)]
            p_ids = np.stack([[p[0] for p in mb] for mb in mbs])
            p_mask = np.stack([[p[1] for p in mb] for mb in mbs])
            block = [np.stack([np.concatenate([[p[2][k][0] for p in mb], [p[2][k][1] for p in mb]]) for mb in mbs])
                     for k in range(3)]
            r = np.stack([np.concatenate([[p[3][0] for p in mb], [p[3][1] for p in mb]]) for mb in mbs])
            want, _ = ts.jit_update(cfg, want, params, p_ids, p_mask, jodpo.Samples(*block), r)
    helpers.close_params(got.params, want.params, 1e-3, E * M)
    # one epoch of one mini-batch is the plain update
    one, _ = ts.jit_rollout_update(cfg, ts.init_state(cfg, params, jax.random.key(7)), params, ids[:2], mask[:2],
                                   jax.tree.map(lambda x: x[:2], samples), rewards[:2], 1, 1)
    plain, _ = ts.jit_update(cfg, ts.init_state(cfg, params, jax.random.key(7)), params, ids[:2], mask[:2],
                             jax.tree.map(lambda x: x[:2], samples), rewards[:2])
    helpers.close_params(one.params, plain.params, 1e-3, 1)


def _sampler_version(t: int, async_mode: bool, s: int) -> int:
    """The policy version step t samples with: the last multiple of s at or before t (async_mode: before t - 1)."""
    last = max(t - 1, 0) if async_mode else t
    return last - last % s


@pytest.mark.parametrize("async_mode,sync_steps", [(True, 1), (False, 2), (True, 2)])
def test_a_lagging_sampler_samples_the_policy_of_its_version(neox, async_mode, sync_steps):
    """open-instruct's async_mode (one update behind) and semi-online sync_steps = s (the sampler refreshed every s
    updates; Lanchantin et al. 2025), alone and together, against a plain loop of on-policy pieces that keeps every
    parameter version: step t samples with theta_v, v the last multiple of s at or before t (async_mode: at or
    before t - 1; step 0 with theta_0), and trains the current parameters; the off-policy KL is logged, about 0
    where the sampler is the policy itself and not where it lags."""
    model, params = neox
    sync = helpers.step_cfg(model)
    lagged = dataclasses.replace(sync, async_mode=async_mode, sync_steps=sync_steps)
    ids, mask = helpers.prompt_batch(model, 1, 4, seed=6)
    T = 4

    def reward(samples):
        tok, m = np.asarray(samples.tokens), np.asarray(samples.mask)
        return (((tok % 2 == 0) * m).sum(-1) / np.maximum(m.sum(-1), 1)).astype(np.float32)

    state, got_tokens, kls = ts.init_state(lagged, params, jax.random.key(1)), [], []
    for _ in range(T):
        samples = ts.jit_sample_completions(lagged, state, ids, mask)
        state, metrics = ts.jit_online_update(lagged, state, params, ids, mask, samples, reward(samples))
        got_tokens.append(np.asarray(samples.tokens))
        kls.append(float(metrics["objective/off_policy_kl"]))
    history = [jax.tree.map(np.asarray, params)]  # theta_0, theta_1, ...
    current = ts.init_state(sync, params, jax.random.key(1))
    versions = [_sampler_version(t, async_mode, sync_steps) for t in range(T + 1)]
    for t in range(T):
        sampler = ts.TrainState(step=jnp.int32(t), params=history[versions[t]], opt_state=None,
                                rng=jax.random.key(1))
        samples = ts.jit_sample_completions(sync, sampler, ids, mask)
        np.testing.assert_array_equal(got_tokens[t], np.asarray(samples.tokens), err_msg=f"step {t}")
        current, _ = ts.jit_update(sync, current, params, ids, mask, samples, reward(samples))
        history.append(jax.tree.map(np.asarray, current.params))
    helpers.close_params(state.params, current.params, 1e-3, T)
    helpers.close_params(state.sampler_params, history[versions[T]], 1e-3, versions[T])  # the sampler of step T
    for t, v in enumerate(versions[:T]):
        assert (abs(kls[t]) < 1e-2) if v == t else (abs(kls[t]) > 10 * abs(kls[0])), (t, v, kls)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_sampler_weights_sample_what_the_state_samples(neox, lora_rank):
    """What a sampler on devices of its own receives (``sampler_weights``: a bf16 run's weights already in bf16, or
    only the LoRA adapters) samples, with the state's draw (``sample_with``), token for token what the state
    samples; and they stay valid after the state is donated to the update."""
    model, params = neox
    model = model.replace(dtype="bfloat16", lora_rank=lora_rank, lora_alpha=8.0)
    trained = params
    if lora_rank:  # adapters away from their zero start, so the merge changes the weights
        adapters = lora.init_adapters(model, lora.resolve_targets(model, None), jax.random.key(2), "float32")
        leaves, tree = jax.tree.flatten(adapters)
        keys = jax.random.split(jax.random.key(3), len(leaves))
        trained = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    cfg = helpers.step_cfg(model)
    state = ts.init_state(cfg, trained, jax.random.key(4)).replace(step=jnp.int32(5))
    ids, mask = helpers.prompt_batch(model, 2, 2, seed=9)
    want = ts.jit_sample_completions(cfg, state, ids, mask, 2, params)
    weights = jax.jit(functools.partial(ts.sampler_weights, cfg))(state.params)
    if not lora_rank:
        assert {x.dtype for x in jax.tree.leaves(weights["layers"]["attn"])} == {jnp.dtype("bfloat16")}
    jax.jit(lambda p: jax.tree.map(jnp.negative, p), donate_argnums=0)(state.params)  # as the update donates them
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    got = jax.jit(ts.sample_with, static_argnums=(0, 6))(cfg, weights, jax.random.key(4), np.int32(5), ids, mask, 2,
                                                         params)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(want.mask).sum() > 0


def test_frozen_models_in_their_compute_form_give_the_same_step(checkpoints, neox):
    """``frozen_params`` (what the program keeps of the reference and the reward model with bf16 compute: weights in
    bf16, norms as loaded) gives the fused bf16 step exactly the numbers of float32 frozen models cast on every
    forward, at about half their bytes; float32 compute and LoRA bases keep theirs as they are."""
    model, params = neox
    rm, rm_params = jodpo.load_model(str(checkpoints["neox"]["reward"]), task="reward")
    model, rm = model.replace(dtype="bfloat16"), rm.replace(dtype="bfloat16")
    ref_bf16, rm_bf16 = frozen_params(model, params), frozen_params(rm, rm_params)
    assert jax.tree.leaves(ref_bf16["layers"]["attn"])[0].dtype == jnp.bfloat16 and ref_bf16["embed"].dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(ref_bf16["layers"]["ln1"])} == {jnp.dtype("float32")}  # norms as loaded
    assert rm_bf16["score"].dtype == jnp.bfloat16
    size = lambda p: sum(x.nbytes for x in jax.tree.leaves(p))  # noqa: E731
    assert size(ref_bf16) < 0.52 * size(params) and size(rm_bf16) < 0.52 * size(rm_params)
    cfg = helpers.step_cfg(model, reward_model=rm, missing_eos_penalty=1.0)
    ids, mask = helpers.prompt_batch(model, 2, 2)
    runs = []
    for ref, rmp in ((params, rm_params), (ref_bf16, rm_bf16)):
        state = ts.init_state(cfg, params, jax.random.key(3))
        for _ in range(2):  # the second step samples from updated parameters
            state, metrics, samples, rewards = ts.jit_online_step(cfg, state, ref, rmp, ids, mask)
        runs.append((state.params, metrics, samples.tokens, rewards))
    (p0, m0, t0, r0), (p1, m1, t1, r1) = runs
    # the same bf16 operands reach every dot: bitwise on the CPU; a GPU may pick another kernel for a dot whose
    # operand is converted in the same fusion, so there the bf16 products may sum in another order
    same = np.testing.assert_array_equal if jax.default_backend() == "cpu" else functools.partial(
        np.testing.assert_allclose, rtol=2e-2, atol=2e-3)
    np.testing.assert_array_equal(np.asarray(t0), np.asarray(t1))
    same(np.asarray(r0), np.asarray(r1))
    for k in m0:
        same(np.asarray(m0[k]), np.asarray(m1[k]), err_msg=k)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        same(np.asarray(a), np.asarray(b))
    assert float(m0["objective/kl"]) != 0  # the second step's policy is not the reference: the comparison has teeth
    # and their forwards convert no weight: float32 frozen models are converted on every forward
    B = ids.shape[1]
    c, cm = samples.tokens[0, :B], samples.mask[0, :B]

    def weight_converts(fn, p):
        shapes = {x.shape[1:] for x in jax.tree.leaves(p["layers"])} | {x.shape for x in jax.tree.leaves(p)}
        return [s for s in helpers.loop_converts(jax.make_jaxpr(fn)(p), inside=True) if s in shapes]

    score = lambda p: ts.score_completions(cfg, p, ids, mask, samples)  # noqa: E731
    reference = lambda p: completion_logprobs(model, p, ids[0], mask[0], c, cm)  # noqa: E731
    assert weight_converts(score, rm_params) and weight_converts(reference, params)
    assert not weight_converts(score, rm_bf16) and not weight_converts(reference, ref_bf16)
    assert frozen_params(model.replace(dtype="float32"), params) is params
    assert frozen_params(model.replace(lora_rank=4, lora_alpha=8.0), params) is params


def test_async_mode_keeps_its_lagging_policy_as_the_sampler_reads_it(neox):
    """async_mode in bf16: the lagging copy is held in the compute form (weights bf16, norms as they are), about half
    the float32 policy's bytes, and samples token for token what the float32 copy it replaces samples; after an
    update it is the pre-update policy in that form."""
    model, params = neox
    model = model.replace(dtype="bfloat16")
    cfg = dataclasses.replace(helpers.step_cfg(model), async_mode=True)
    state = ts.init_state(cfg, params, jax.random.key(4))
    assert state.sampler_params["layers"]["mlp"]["up"].dtype == jnp.bfloat16
    assert state.sampler_params["layers"]["ln1"]["scale"].dtype == jnp.float32
    size = lambda p: sum(x.nbytes for x in jax.tree.leaves(p))  # noqa: E731
    assert size(state.sampler_params) < 0.52 * size(state.params)
    ids, mask = helpers.prompt_batch(model, 2, 2, seed=9)
    got = ts.jit_sample_completions(cfg, state, ids, mask)
    want = ts.jit_sample_completions(cfg, state.replace(sampler_params=params), ids, mask)  # float32, as before
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    before = jax.tree.map(np.asarray, state.params)
    rewards = jnp.asarray(np.arange(8, dtype=np.float32).reshape(2, 4))
    state, _ = ts.jit_update(cfg, state, params, ids, mask, got, rewards)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)))
    for a, b in zip(jax.tree.leaves(state.sampler_params), jax.tree.leaves(ts.sampler_weights(cfg, before))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _scan_outputs(jaxpr) -> list:
    """(shape, dtype) of every output of every ``scan`` in ``jaxpr``, nested ones included."""
    return [(v.aval.shape, v.aval.dtype) for eqn, _ in helpers.jaxpr_eqns(jaxpr) if eqn.primitive.name == "scan"
            for v in eqn.outvars]


def test_accumulation_differentiates_the_weights_as_the_forward_reads_them(neox):
    """float32 master weights, bf16 compute, two micro-batches: each micro-batch is differentiated with respect to
    the bf16 weights (the layers' backward stacks bf16 gradients, half the bytes), the embedding table's float32,
    and the sum is float32: the float32 path's gradient up to the rounding of a bf16 sum. One micro-batch keeps the
    float32 path."""
    model, params = neox
    model = model.replace(dtype="bfloat16")
    cfg = helpers.step_cfg(model)
    ids, mask = helpers.prompt_batch(model, 2, 2)
    samples = ts.jit_sample_completions(cfg, ts.init_state(cfg, params, jax.random.key(0)), ids, mask)
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)), jnp.float32)
    batches = (ids, mask, samples.tokens, samples.mask, rewards)

    def loss_fn(p, mb):
        i, m, t, tm, r = mb
        return online_dpo_loss(model, p, params, i, m, t, tm, r, beta=0.1)

    grads, _ = jax.jit(lambda p, b: ts._accumulate(model, loss_fn, p, b))(params, batches)
    f32_path = jax.jit(lambda p, mb: jax.grad(lambda q: loss_fn(q, mb)[0])(p))
    want = jax.tree.map(lambda a, b: (a + b) / 2, *(f32_path(params, jax.tree.map(lambda x: x[a], batches))
                                                     for a in range(2)))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        assert g.dtype == jnp.float32, path
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-2, atol=2e-2 * scale, err_msg=str(path))
    up = params["layers"]["mlp"]["up"]
    stacked = lambda A: sorted(str(dt) for shape, dt in _scan_outputs(jax.make_jaxpr(  # noqa: E731
        lambda p: ts._accumulate(model, loss_fn, p, jax.tree.map(lambda x: x[:A], batches)))(params))
        if shape == up.shape)
    # stacked [L, ...] arrays of a layer weight's shape: with two micro-batches the layers' backward stacks their bf16
    # gradients and the only float32 one is the sum; with one, the forward keeps each layer's bf16 cast of its weight
    # and the backward stacks the float32 gradients, converted inside the layer loop
    assert stacked(2) == ["bfloat16", "float32"]
    assert stacked(1) == ["bfloat16", "bfloat16", "float32", "float32"]

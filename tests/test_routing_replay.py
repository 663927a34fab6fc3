"""Routing replay (jodpo.logprobs, moe.route's forced experts, the sampler's Samples.experts) and moe/route_flip_rate:
forced experts weighed by the router's renormalised probabilities, with the router's gradient; the sampler's record
of every completion token's experts; replayed log-probs against a forward forced to those routes through the one-hot
experts; the flip rate 0 in one dtype and > 0 for bf16 sampling of a model whose router nearly ties. The CLI run with
replay on is tests/test_export_script.py's Qwen3-MoE run."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import losses, sampling
from jodpo.logprobs import LossConfig, OnlineBatch, policy_logprobs
from jodpo.models import decoder, moe
from jodpo.models.model import MoE

E, K, LAYERS = 6, 2, 2


def _model(dtype="float32"):
    m = MoE(num_experts=E, top_k=K, expert_dim=8, norm_topk_prob=True, shared_dim=0)
    return decoder.Model(family="qwen3_moe", task="causal_lm", vocab_size=48, hidden_size=16, num_layers=LAYERS,
                         num_heads=2, num_kv_heads=1, head_dim=8, mlp=None, norms=decoder.Norms("rmsnorm", 1e-6),
                         qkv_bias=False, out_bias=False,
                         parallel_residual=False, rope=decoder.Rope(8, (1.0,) * 4), tie_embeddings=False, moe=m,
                         dtype=dtype)


@pytest.fixture(scope="module")
def near_ties():
    """A tiny MoE policy whose router columns are one column plus 1e-3 of noise: in float32 its experts' logits are
    apart, in bf16 (8 bits of mantissa on the shared part) they nearly tie."""
    model = _model()
    params = jodpo.init_params(model, jax.random.key(0), std=0.5)
    router = params["layers"]["moe"]["router"]
    near = router[..., :1] + 1e-3 * jax.random.normal(jax.random.key(1), router.shape)
    return model, {**params, "layers": {**params["layers"], "moe": {**params["layers"]["moe"], "router": near}}}


PROMPTS = (jnp.array([[0, 3, 4, 5, 6], [7, 8, 9, 10, 11]], jnp.int32), jnp.array([[0, 1, 1, 1, 1], [1] * 5], jnp.int32))
CONFIG = sampling.SamplingConfig(max_new_tokens=6, temperature=1.0, eos_token_ids=(1, 2), chunk=4)


def test_forced_experts_take_the_routers_renormalised_probabilities_and_its_gradient(near_ties):
    model, params = near_ties
    p = jax.tree.map(lambda a: a[0], params["layers"]["moe"])
    x = jax.random.normal(jax.random.key(2), (1, 4, model.hidden_size))
    forced = jnp.array([[[5, 0], [-1, -1], [3, 4], [-1, -1]]], jnp.int32)  # tokens 1 and 3 route themselves

    def ours(p):
        y, routing = moe.block(model, p, x, forced=forced)
        return jnp.sum(jnp.sin(y)), routing

    def by_hand(p):  # the forced experts' probabilities, renormalised, through every expert (one-hot)
        x_TD = x[0]
        # float32 products, as the model's: XLA's default on a GPU (TF32) moves these near ties' choice
        probs = jax.nn.softmax(jnp.matmul(x_TD, p["router"], precision="highest"), -1)
        own = jax.lax.top_k(probs, K)[1]
        chosen = jnp.where(forced[0] >= 0, forced[0], own)
        w = jnp.take_along_axis(probs, chosen, -1)
        y = moe.dense_experts(model, p, x_TD, chosen, w / w.sum(-1, keepdims=True))
        return jnp.sum(jnp.sin(y)), own

    (got, routing), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(p)
    (want, own), want_grads = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(p)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(routing.experts[0], own)  # the router's own choice, whatever was forced
    assert not np.array_equal(np.sort(own[::2], -1), np.sort(forced[0, ::2], -1))  # forcing changed the experts
    for name in ("router", "gate", "up", "down"):
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-6)
    assert np.abs(grads["router"]).max() > 1e-3  # the router learns through the forced experts' weights


def test_the_sampler_records_each_completion_tokens_experts_and_one_dtype_flips_none(near_ties):
    """float32 sampling and training: every recorded token's experts are the training forward's own (flip rate 0),
    the replayed log-probs are the plain ones, and the prompt's tokens route in the prefill as in training."""
    model, params = near_ties
    (ids, mask), n = PROMPTS, 2
    sample = jax.jit(sampling.sample, static_argnums=(0, 5, 6))
    out = sample(model, params, ids, mask, jax.random.key(3), CONFIG, n)
    refilled = sample(model, params, ids, mask, jax.random.key(3), dataclasses.replace(CONFIG, slots=1), n)
    for name in ("tokens", "mask", "experts"):  # one prompt in flight at a time: the same tokens and experts
        np.testing.assert_array_equal(np.asarray(getattr(refilled, name)), np.asarray(getattr(out, name)))
    T = CONFIG.max_new_tokens
    assert out.experts.shape == (n * 2, T, LAYERS, K) and out.experts.dtype == jnp.int32
    follows = np.pad(np.asarray(out.mask)[:, 1:], ((0, 0), (0, 1))) > 0  # a real token after it: recorded
    np.testing.assert_array_equal(np.asarray(out.experts).min((2, 3)) >= 0, follows)
    np.testing.assert_array_equal(np.asarray(out.experts).max((2, 3)) < 0, ~follows)
    assert follows.sum() >= 8 and (~follows).sum() >= 4

    batch = OnlineBatch(ids, mask, out.tokens, out.mask, jnp.zeros(n * 2), sample_experts=out.experts)
    forward = jax.jit(policy_logprobs, static_argnums=(0, 3))
    plain, terms = forward(model, params, batch, LossConfig())
    replayed, replay_terms = forward(model, params, batch, LossConfig(moe_routing_replay=True))
    assert float(terms["moe/route_flip_rate"]) == 0.0 == float(replay_terms["moe/route_flip_rate"])
    np.testing.assert_allclose(replayed, plain, rtol=1e-6, atol=1e-6)

    _, _, prefill = decoder.hidden_states(model, params, ids, mask, decoder.init_cache(model, 2, 5), empty_cache=True,
                                          with_router=True)
    _, _, trained = decoder.hidden_states(model, params, ids, mask, with_router=True)
    real = np.asarray(mask, bool)
    np.testing.assert_array_equal(np.asarray(prefill.experts)[:, real], np.asarray(trained.experts)[:, real])


def test_bf16_sampling_flips_near_ties_and_replay_equals_a_forward_forced_to_its_experts(near_ties, monkeypatch):
    """XPO's pair from a bf16 sampler (rows [0, B) the policy's, recorded; [B, 2B) the reference's, -1), trained in
    float32: the flip rate is > 0, and the loss's replayed log-probs (shared prompt, grouped experts) equal the plain
    forward of the concatenated rows forced to the sampler's experts through the one-hot experts."""
    model, params = near_ties
    ids, mask = PROMPTS
    bf16 = model.replace(dtype="bfloat16")
    out = jax.jit(sampling.sample_pair, static_argnums=(0, 6))(bf16, params, params, ids, mask, jax.random.key(4),
                                                               CONFIG)
    experts = np.asarray(out.experts)
    assert (experts[2:] == -1).all() and (experts[:2] >= 0).any()

    batch = OnlineBatch(ids, mask, out.tokens, out.mask, jnp.zeros(4), sample_experts=out.experts)
    forward = jax.jit(policy_logprobs, static_argnums=(0, 3))
    plain, terms = forward(model, params, batch, LossConfig())
    replayed, replay_terms = forward(model, params, batch, LossConfig(moe_routing_replay=True))
    flip = float(terms["moe/route_flip_rate"])
    assert 0.1 < flip <= 1.0, flip
    # replayed, the router's own choice in layer 1 reads layer 0's output under the replayed experts
    assert 0.1 < float(replay_terms["moe/route_flip_rate"]) <= 1.0

    # the forced forward: rows prompt + completion, the completion tokens' experts from the sampler, -1 elsewhere
    P = ids.shape[1]
    rows = jnp.concatenate([jnp.concatenate([ids] * 2), out.tokens], 1)
    rows_mask = jnp.concatenate([jnp.concatenate([mask] * 2), out.mask], 1)
    routes = jnp.pad(out.experts.transpose(2, 0, 1, 3), ((0, 0), (0, 0), (P, 0), (0, 0)), constant_values=-1)
    block = moe.block
    monkeypatch.setattr(moe, "block", lambda model, p, x, forced=None: block(model, p, x, moe.dense_experts, forced))
    h, _ = decoder.hidden_states(model, params, rows, rows_mask, routes=routes)
    logits = jodpo.models.heads.lm_head(model, params, h[:, P - 1:-1])
    want = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), out.tokens[..., None], -1)[..., 0]
    want = np.where(np.asarray(out.mask) > 0, want, 0.0)
    np.testing.assert_allclose(replayed, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(replayed) - np.asarray(plain))[:2].max() > 1e-3  # the flips changed the log-probs

    # XPO's loss with replay: the policy's rows replayed, the reference's own; the flip rate logged
    loss, metrics = losses.xpo_loss(model, params, params, ids, mask, out.tokens, out.mask, jnp.array([1., 0, 0, 1]),
                                    beta=0.1, sample_experts=out.experts, moe_routing_replay=True)
    assert np.isfinite(float(loss)) and float(metrics["moe/route_flip_rate"]) == pytest.approx(
        float(replay_terms["moe/route_flip_rate"]))


def test_replay_without_the_samplers_experts_or_experts_is_refused(near_ties):
    model, params = near_ties
    ids, mask = PROMPTS
    with pytest.raises(ValueError, match="sample_experts"):
        losses.online_dpo_loss(model, params, params, ids, mask, ids, mask, jnp.zeros(2), beta=0.1,
                               moe_routing_replay=True)
    dense = model.replace(moe=None, mlp=decoder.MLP(8, "silu"))
    with pytest.raises(ValueError, match="no experts"):
        losses.completion_logprobs(dense, jodpo.init_params(dense, jax.random.key(0)), ids, mask, ids, mask,
                                   routes=jnp.zeros((2, 5, LAYERS, K), jnp.int32))

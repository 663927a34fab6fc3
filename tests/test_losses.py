"""Each loss against a hand-computed value; pairing, penalties, log-probs and reward plumbing."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import losses
from jodpo import pair_losses
from jodpo import scoring
from jodpo.program import rewards
from tests import hf_fixtures

BETA, EPS = 0.5, 0.1
CH, RJ = 0.8, -0.4  # log-ratios of the chosen and rejected completion
D = CH - RJ
ls = lambda x: math.log(1 / (1 + math.exp(-x)))  # log-sigmoid
sg = lambda x: 1 / (1 + math.exp(-x))

EXPECTED = {  # written out from the formulas of TRL's dpo_trainer.py
    "sigmoid": -(1 - EPS) * ls(BETA * D) - EPS * ls(-BETA * D),
    "ipo": (D - 1 / (2 * BETA)) ** 2,
    "hinge": max(0.0, 1 - BETA * D),
    "robust": (-(1 - EPS) * ls(BETA * D) + EPS * ls(-BETA * D)) / (1 - 2 * EPS),
    "exo_pair": sg(BETA * D) * (ls(BETA * D) - math.log(1 - EPS)) + sg(-BETA * D) * (ls(-BETA * D) - math.log(EPS)),
    "nca_pair": -ls(BETA * CH) - 0.5 * ls(-BETA * CH) - 0.5 * ls(-BETA * RJ),
    "sppo_hard": (CH - 0.5 / BETA) ** 2 + (RJ + 0.5 / BETA) ** 2,
    "apo_zero": 1 - sg(BETA * CH) + sg(BETA * RJ),
    "apo_down": sg(BETA * CH) + 1 - sg(BETA * D),
    "discopop": -ls(BETA * D) * (1 - sg(BETA * D / 0.05)) + math.exp(-BETA * D) * sg(BETA * D / 0.05),
    # SimPO (TRL's CPOTrainer): the pair holds average log-probs; gamma 0.5 (TRL's default), CPO's label smoothing
    "simpo": -(1 - EPS) * ls(BETA * D - 0.5) - EPS * ls(-(BETA * D - 0.5)),
    # R-DPO (Park et al. 2024, eq. 9): alpha (|y_c| - |y_r|) added to the margin, lengths 4 and 2
    "rdpo": -(1 - EPS) * ls(BETA * D + 0.3 * 2) - EPS * ls(-(BETA * D + 0.3 * 2)),
}


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_each_loss_against_hand_computed_value(name):
    pair = losses.Pair(chosen=jnp.array([CH]), rejected=jnp.array([RJ]), chosen_len=jnp.array([4.0]),
                       rejected_len=jnp.array([2.0]))
    got = float(losses.get_loss(name)(pair, BETA, losses.LossOptions(label_smoothing=EPS, rdpo_alpha=0.3))[0])
    assert got == pytest.approx(EXPECTED[name], rel=1e-6)


def test_ipo_length_normalised_and_unknown_loss():
    pair = losses.Pair(jnp.array([CH]), jnp.array([RJ]), jnp.array([4.0]), jnp.array([2.0]))
    got = pair_losses.ipo_loss(pair, BETA, losses.LossOptions(ipo_length_normalized=True))[0]
    assert float(got) == pytest.approx((CH / 4 - RJ / 2 - 1 / (2 * BETA)) ** 2, rel=1e-6)
    with pytest.raises(ValueError, match="unknown loss_type 'dpo'.*'sigmoid'"):
        losses.get_loss("dpo")
    with pytest.raises(ValueError, match="robust"):
        losses.check_loss_options("robust", losses.LossOptions(label_smoothing=0.5))


def test_pairing_ties_and_nan_follow_trl():
    r = jnp.array([1.0, 2.0, jnp.nan, 0.5, 1.0, 3.0, 0.0, jnp.nan])  # B=4: (1,1) (2,3) (nan,0) (0.5,nan)
    chosen, rejected = scoring.pair_indices(r)
    assert chosen.tolist() == [0, 5, 6, 7] and rejected.tolist() == [4, 1, 2, 3]


def test_penalty_modes():
    r = jnp.array([1.0, 2.0, 3.0])
    has = jnp.array([True, False, False])
    assert scoring.apply_eos_penalty(r, has, 1.0).tolist() == [1.0, 1.0, 2.0]  # TRL: subtract
    assert scoring.apply_eos_penalty(r, has, None, -5.0).tolist() == [1.0, -5.0, -5.0]  # open-instruct: replace
    assert scoring.apply_eos_penalty(r, has).tolist() == [1.0, 2.0, 3.0]
    ids = jnp.array([[4, 7, 0], [4, 5, 6]])
    assert scoring.contains_eos(ids, jnp.array([[1, 1, 0], [1, 1, 1]]), (7,)).tolist() == [True, False]
    assert scoring.contains_eos(ids, jnp.array([[1, 0, 0], [1, 1, 1]]), (7,)).tolist() == [False, False]


def test_reward_functions_weighted_nansum():
    f = lambda prompts, completions, completion_ids, **kw: [1.0, None, float("nan")]
    g = lambda prompts, completions, completion_ids, extra, **kw: [2.0, 3.0, None]
    out = rewards.call_reward_functions([f, g], ["p"] * 3, ["a", "b", "c"], [[1]] * 3, weights=[0.5, 2.0],
                                        extra=[0, 1, 2])
    np.testing.assert_allclose(out, [4.5, 6.0, 0.0])
    with pytest.raises(ValueError, match="reward_weights"):
        rewards.call_reward_functions([f], ["p"] * 3, ["a"] * 3, None, weights=[1.0, 2.0])


def test_completions_without_any_reward_warn_once_with_their_count():
    def sparse(prompts, completions, completion_ids, **kw):
        return [None, 1.0, None, float("nan")]

    rs = rewards.RewardSet(None, None, None, [sparse], None, shared_tokenizer=False, chat=False)
    with pytest.warns(UserWarning, match=r"3 of 4 completions got no reward \(every reward returned None or NaN\) "
                                         "and are scored 0") as caught:
        out = rs.score(["p"] * 4, ["a"] * 4, None, {})
        rs.score(["p"] * 4, ["a"] * 4, None, {})
    assert sum("got no reward" in str(w.message) for w in caught) == 1
    np.testing.assert_array_equal(out, [0.0, 1.0, 0.0, 0.0])


def test_completion_logprobs_equal_full_forward_and_truncate_like_trl(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["qwen2"]["causal_lm"]))
    rng = np.random.default_rng(0)
    P, pm = hf_fixtures.padded_batch(rng, [6, 3, 5], model.pad_token_id, "left")
    C, cm = hf_fixtures.padded_batch(rng, [4, 2, 4], model.pad_token_id, "right")
    lp = np.asarray(losses.completion_logprobs(model, params, P, pm, C, cm))
    full = jax.nn.log_softmax(jodpo.logits(model, params, np.concatenate([P, C], 1), np.concatenate([pm, cm], 1)))
    want = np.take_along_axis(np.asarray(full[:, P.shape[1] - 1:-1]), C[..., None], -1)[..., 0] * cm
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-6)
    # max_length drops the leftmost prompt columns in this forward only (TRL's num_tokens_to_truncate).
    cut = np.asarray(losses.completion_logprobs(model, params, P, pm, C, cm, max_length=7))
    ref = np.asarray(losses.completion_logprobs(model, params, P[:, 3:], pm[:, 3:], C, cm))
    # two programs (the cut inside, or the input cut): a log-prob is logit - logsumexp, terms of the batch's log-prob
    # scale that either program may reassociate, so a small log-prob differs by float32 ulps of the largest
    np.testing.assert_allclose(cut, ref, rtol=1e-6, atol=16 * np.finfo(np.float32).eps * np.abs(ref).max())
    # open-instruct's temperature-scaled log-probs: log_softmax(logits / (T + 1e-7)) at the same positions.
    hot = np.asarray(losses.completion_logprobs(model, params, P, pm, C, cm, temperature=0.7))
    scaled = jax.nn.log_softmax(jodpo.logits(model, params, np.concatenate([P, C], 1), np.concatenate([pm, cm], 1))
                                / (0.7 + 1e-7))
    want = np.take_along_axis(np.asarray(scaled[:, P.shape[1] - 1:-1]), C[..., None], -1)[..., 0] * cm
    np.testing.assert_allclose(hot, want, rtol=1e-5, atol=1e-6)
    assert np.abs(hot - lp).max() > 1e-2


def test_logprobs_of_a_large_vocabulary_in_chunks_of_tokens_equal_all_at_once(checkpoints, monkeypatch):
    """Where all positions' float32 logits would pass ``LOGITS_BYTES``, the LM head and log-softmax run a few
    positions at a time (their logits recomputed in the backward): the same log-probs and the same gradient."""
    from jodpo import logprobs

    model, params = jodpo.load_model(str(checkpoints["qwen2"]["causal_lm"]))
    rng = np.random.default_rng(1)
    P, pm = hf_fixtures.padded_batch(rng, [6, 3, 5], model.pad_token_id, "left")
    C, cm = hf_fixtures.padded_batch(rng, [5, 2, 4], model.pad_token_id, "right")
    w = rng.normal(size=C.shape).astype(np.float32)

    def value_and_grad():
        f = lambda p: (losses.completion_logprobs(model, p, P, pm, C, cm, temperature=0.7) * w).sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(f))(params)

    def scans():
        return str(jax.make_jaxpr(lambda p: losses.completion_logprobs(model, p, P, pm, C, cm))(params)).count("scan[")

    whole, layer_scans = value_and_grad(), scans()
    monkeypatch.setattr(logprobs, "LOGITS_BYTES", 4 * 3 * model.vocab_size * 2)  # 2 positions a chunk: 3 chunks
    chunked = value_and_grad()
    assert scans() == layer_scans + 1  # the chunks' map
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(whole[1]))
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


def test_the_logits_chunks_are_sized_by_the_rows_of_one_device(checkpoints, monkeypatch):
    """``LOGITS_BYTES`` is a device's budget: 16 rows split over 8 devices of the batch's axes chunk as 2 rows do on
    one (traced on an abstract mesh: nothing compiled, no devices needed)."""
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

    from jodpo import logprobs

    model, _ = jodpo.load_model(str(checkpoints["qwen2"]["causal_lm"]))
    key = "embed" if model.tie_embeddings else "lm_head"
    monkeypatch.setattr(logprobs, "LOGITS_BYTES", 4 * 2 * model.vocab_size * 2)  # 2 rows x 2 positions a chunk
    mesh = AbstractMesh((8, 1, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)

    def chunks(sharding):
        w = jax.ShapeDtypeStruct((model.vocab_size, model.hidden_size), jnp.float32, sharding=sharding)
        h = jax.ShapeDtypeStruct((16, 6, model.hidden_size), jnp.float32, sharding=sharding)
        ids = jax.ShapeDtypeStruct((16, 6), jnp.int32, sharding=sharding)
        p = {"embed": w, key: w}
        jaxpr = jax.jit(lambda p, h, ids: logprobs.token_logprobs(model, p, h, ids)).trace(p, h, ids).jaxpr
        return [int(n) for n in re.findall(r"scan\[.*?length=(\d+)", str(jaxpr), re.S)]

    assert chunks(NamedSharding(mesh, PartitionSpec())) == [3]  # 2 rows a device: 2 positions a chunk
    assert chunks(None) == [6]  # 16 rows on one device: 1 position a chunk


def test_on_device_scoring_equals_scoring_the_text_without_eos(checkpoints):
    rm, rm_params = jodpo.load_model(str(checkpoints["llama"]["reward"]), task="reward")
    policy, _ = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    rewards.check_shared_vocab(policy, rm)
    pad, eos = rm.pad_token_id, 7
    P = np.array([[pad, 10, 11], [12, 13, 14]], np.int32)
    pm = (P != pad).astype(np.int32)
    C = np.array([[20, 21, eos, pad], [22, 23, 24, 25]], np.int32)
    cm = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    got = scoring.score_tokens(rm, rm_params, P, pm, C, cm, (eos,))
    rows = [[10, 11, 20, 21], [12, 13, 14, 22, 23, 24, 25]]  # what TRL scores: the text, EOS skipped
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [4, 7], pad, "right")
    ids[0, :4], ids[1, :7] = rows[0], rows[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(jodpo.reward_scores(rm, rm_params, ids, mask)),
                               rtol=1e-5)
    # One prompt row shared by both completions (the online step's layout) scores the same.
    shared = scoring.score_tokens(rm, rm_params, P[1:], pm[1:], C, cm, (eos,))
    repeated = scoring.score_tokens(rm, rm_params, P[[1, 1]], pm[[1, 1]], C, cm, (eos,))
    np.testing.assert_allclose(np.asarray(shared), np.asarray(repeated), rtol=1e-5)
    with pytest.raises(ValueError, match="embedding has only 320 rows"):
        rewards.check_shared_vocab(policy.replace(vocab_size=999), rm)


def test_online_dpo_loss_is_jittable_and_takes_one_prompt_row_per_pair(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    rng = np.random.default_rng(1)
    P, pm = hf_fixtures.padded_batch(rng, [4, 3], model.pad_token_id, "left")
    C, cm = hf_fixtures.padded_batch(rng, [3, 2, 3, 1], model.pad_token_id, "right")
    r = jnp.array([0.1, 0.5, 0.3, 0.2])
    f = jax.jit(lambda p, P, pm: losses.online_dpo_loss(model, p, params, P, pm, C, cm, r, beta=0.1,
                                                        eos_token_ids=(5,)))
    loss_b, m_b = f(params, P, pm)
    loss_2b, m_2b = f(params, np.concatenate([P, P]), np.concatenate([pm, pm]))
    assert float(loss_b) == pytest.approx(math.log(2), rel=1e-5)  # policy == reference: z = 0
    assert float(loss_b) == pytest.approx(float(loss_2b), rel=1e-6)
    assert float(m_b["objective/kl"]) == 0.0 and float(m_b["rewards/accuracies"]) == 0.0
    # temperature-scaled log-probs (open-instruct) reach the loss: chosen rows are 2 (0.3 > 0.1) and 1 (0.5 > 0.2)
    _, m_t = losses.online_dpo_loss(model, params, params, P, pm, C, cm, r, beta=0.1, logprob_temperature=0.7)
    S_t = np.asarray(losses.completion_logprobs(model, params, P, pm, C, cm, temperature=0.7)).sum(-1)
    assert float(m_t["logps/chosen"]) == pytest.approx((S_t[2] + S_t[1]) / 2, rel=1e-5)


def test_accuracies_count_the_pairs_whose_margin_is_positive():
    S, S_ref = jnp.array([1.0, -2.0, 0.5, 3.0, 6.0, 4.0]), jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    chosen, rejected = jnp.array([0, 1, 4]), jnp.array([2, 3, 5])  # margins 0.05, -0.5, 0.3 (x beta 0.1)
    _, m = losses.preference_loss(S, S_ref, jnp.ones(6), chosen, rejected, beta=0.1)
    assert float(m["rewards/accuracies"]) == pytest.approx(2 / 3)
    # the margins are differences of beta x log-prob sums up to 0.1 x 6: their mean (-0.05) carries float32 ulps of
    # that scale, which relative to -0.05 is about 1e-6 already
    np.testing.assert_allclose(float(m["rewards/margins"]), (0.05 - 0.5 + 0.3) / 3, rtol=0,
                               atol=8 * np.finfo(np.float32).eps * 0.1 * 6)


def _online_batch(model):
    rng = np.random.default_rng(1)
    P, pm = hf_fixtures.padded_batch(rng, [4, 3, 5], model.pad_token_id, "left")
    C, cm = hf_fixtures.padded_batch(rng, [3, 6, 2, 5, 2, 4], model.pad_token_id, "right")
    return P, pm, C, cm, jnp.array([0.1, 0.5, 0.9, 0.3, 0.2, 0.4])  # chosen rows 3, 1, 2; rejected 0, 4, 5


def test_simpo_online_equals_its_formula_without_a_reference(checkpoints):
    """SimPO from the per-token log-probs in numpy: -log sigmoid(beta (avg_c - avg_r) - gamma), rewards/* = beta x
    the average log-prob (TRL's CPO), no reference (ref_params None) and no KL metrics; a gradient step lowers it."""
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    P, pm, C, cm, r = _online_batch(model)
    beta, gamma = 2.0, 0.3
    simpo = functools.partial(losses.online_dpo_loss, model, beta=beta, loss_type="simpo",
                              options=losses.LossOptions(simpo_gamma=gamma))

    @jax.jit
    def step(p):  # one compile: the loss, its gradient step, the log-probs
        (loss, m), g = jax.value_and_grad(lambda p: simpo(p, None, P, pm, C, cm, r), has_aux=True)(p)
        after, _ = simpo(jax.tree.map(lambda x, d: x - 1e-2 * d, p, g), None, P, pm, C, cm, r)
        return loss, m, after, losses.completion_logprobs(model, p, P, pm, C, cm)

    loss, m, after, lp = step(params)
    assert float(after) < float(loss) - 1e-4  # it trains: a gradient step lowers it
    lp = np.asarray(lp, np.float64)
    avg = lp.sum(1) / cm.sum(1)
    c, j = np.array([3, 1, 2]), np.array([0, 4, 5])
    z = beta * (avg[c] - avg[j]) - gamma
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-z))), rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/chosen"]), beta * avg[c].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["logps/rejected"]), avg[j].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["objective/entropy"]), -lp.sum(1).mean(), rtol=1e-5)
    assert not {"objective/kl", "objective/non_score_reward", "objective/rlhf_reward"} & set(m)
    with pytest.raises(ValueError, match="compares with a reference: give ref_params"):
        losses.online_dpo_loss(model, params, None, P, pm, C, cm, r, beta=beta)


def test_ld_alpha_and_rdpo_online_equal_their_formulas(checkpoints):
    """LD-DPO: per pair, tokens past the shorter completion's length weigh ld_alpha in both log-probs (written out
    as a loop); R-DPO adds alpha (|y_c| - |y_r|) to DPO's margin. The KL metric stays the plain sum."""
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    ref = jax.tree.map(lambda x: x * 1.05, params)  # a reference apart from the policy
    P, pm, C, cm, r = _online_batch(model)
    alpha = 0.25

    @jax.jit
    def everything(params, ref):  # one compile
        run = functools.partial(losses.online_dpo_loss, model, params, ref, P, pm, C, cm, r, beta=0.5)
        return (run(options=losses.LossOptions(ld_alpha=alpha)),
                run(loss_type="rdpo", options=losses.LossOptions(rdpo_alpha=0.1)),
                *(losses.completion_logprobs(model, p, P, pm, C, cm) for p in (params, ref)))

    (loss, m), (rdpo, _), lp, lq = everything(params, ref)
    lp, lq, n, B = np.asarray(lp, np.float64), np.asarray(lq, np.float64), cm.sum(1), 3
    w = np.zeros(cm.shape)
    for row in range(2 * B):
        shared = min(n[row % B], n[row % B + B])
        for t in range(n[row]):
            w[row, t] = 1.0 if t < shared else alpha
    c, j = np.array([3, 1, 2]), np.array([0, 4, 5])
    ratio = (lp * w).sum(1) - (lq * w).sum(1)
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-0.5 * (ratio[c] - ratio[j])))), rtol=1e-5)
    np.testing.assert_allclose(float(m["logps/chosen"]), (lp * w).sum(1)[c].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["objective/kl"]), (lp - lq).sum(1).mean(), rtol=1e-5, atol=1e-6)
    plain = lp.sum(1) - lq.sum(1)
    z = 0.5 * (plain[c] - plain[j]) + 0.1 * (n[c] - n[j])
    np.testing.assert_allclose(float(rdpo), np.mean(np.log1p(np.exp(-z))), rtol=1e-5)


@pytest.mark.parametrize("loss_type,options,match", [
    ("sigmoid", dict(rdpo_alpha=0.1), "rdpo_alpha is R-DPO's length term"),
    ("sigmoid", dict(ld_alpha=1.5), "ld_alpha must be in"),
    ("simpo", dict(ld_alpha=0.5), "ld_alpha weights DPO's log-ratios")])
def test_length_options_that_do_not_apply_are_refused(loss_type, options, match):
    with pytest.raises(ValueError, match=match):
        losses.check_loss_options(loss_type, losses.LossOptions(**options))

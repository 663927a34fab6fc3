"""k completions per prompt and one pair each (jodpo.pairing, num_generations, pairing): the choice against plain
Python, the step against TRL's two-completion step on the chosen pairs, and a judge's round robin."""
import dataclasses
import types

import jax
import numpy as np
import pytest

from jodpo import pairing as P
from jodpo.program import loop
from jodpo import train_step as ts
from tests import helpers


def test_pair_rows_and_group_metrics_equal_python():
    k, B = 4, 5
    rng = np.random.default_rng(0)
    s = rng.integers(0, 3, (k, B)).astype(np.float32)
    s[:, 1] = 2.0  # all equal: no pair
    s[:, 2] = [np.nan, 1.0, np.nan, 0.0]  # NaN left out
    s[:, 3] = np.nan  # nothing finite: no pair
    rows, weights = P.pair_rows(s.reshape(-1), k, "best_worst", jax.random.key(0))
    rows, weights = np.asarray(rows), np.asarray(weights)
    spread, zero = [], 0
    for b in range(B):
        finite = [(v, i) for i, v in enumerate(s[:, b]) if np.isfinite(v)]
        hi, lo = max(finite, default=(0, 0), key=lambda x: (x[0], -x[1])), min(finite, default=(0, 0))
        has_pair = bool(finite) and hi[0] > lo[0]
        assert weights[b] == float(has_pair)
        if has_pair:  # the first of the highest against the first of the lowest
            assert (rows[b], rows[B + b]) == (hi[1] * B + b, lo[1] * B + b)
        spread.append(hi[0] - lo[0] if has_pair else 0.0)
        zero += not has_pair
    m = P.group_metrics(s.reshape(-1), k)
    np.testing.assert_allclose(float(m["objective/scores_spread"]), np.mean(spread), rtol=1e-6)
    assert float(m["frac_reward_zero_std"]) == pytest.approx(zero / B) and zero == 2
    # random: two different completions of the prompt itself, in sampled order; k = 2: completions 0 and 1
    rows, weights = (np.asarray(x) for x in P.pair_rows(s.reshape(-1), k, "random", jax.random.key(1)))
    first, second = rows[:B] // B, rows[B:] // B
    assert (rows % B == np.tile(np.arange(B), 2)).all() and (first < second).all() and (weights == 1).all()
    assert len({tuple(first), tuple(second)}) > 1 or len(set(first)) > 1  # not a fixed choice
    assert np.asarray(P.pair_rows(s[:2].reshape(-1), 2, "random", jax.random.key(1))[0]).tolist() == list(range(2 * B))
    assert P.resolve_pairing("auto", 2) == "random" and P.resolve_pairing("auto", 3) == "best_worst"


def test_round_robin_win_scores_and_verdicts():
    k = 3
    assert P.round_robin(k) == [(0, 1), (0, 2), (1, 2)]
    p = np.array([[0.9, 0.2, np.nan]], np.float32)  # 0 beats 1, 2 beats 0, 1-2 unknown
    w = P.win_scores(p, k)[0]
    np.testing.assert_allclose(w, [(0.9 + 0.2) / 2, 0.1, 0.8], rtol=1e-6)
    v = P.verdict_of(np.repeat(p, 3, 0), k, np.array([2, 1, 0]), np.array([0, 2, 0]))  # three questions of it
    np.testing.assert_allclose(v[0], 0.8, rtol=1e-6)  # 2 beats 0: 1 - p(0 beats 2)
    assert np.isnan(v[1]) and np.isnan(v[2])


def test_best_of_k_step_equals_the_two_completion_step_on_the_chosen_pairs(neox):
    """k = 4, best_worst, with the EOS penalty: one decode samples the k completions (the prompt's prefill shared:
    test_sampling checks they are the repeated prompts' with their keys), the pair is the highest against the lowest penalised
    reward, a prompt whose rewards all tie weighs nothing; the jitted step equals TRL's two-completion step
    (``update``) on the pairs a Python loop picks, the tied prompt left out (loss, gradients, parameters)."""
    model, params = neox
    k, B = 4, 4
    cfg = helpers.step_cfg(model, num_generations=k, missing_eos_penalty=0.5)
    ids, mask = helpers.prompt_batch(model, 1, B, seed=4)
    state = ts.init_state(cfg, params, jax.random.key(2))
    samples = ts.jit_sample_completions(cfg, state, ids, mask)
    assert samples.tokens.shape[:2] == (1, k * B)
    assert len({tuple(r) for r in np.asarray(samples.tokens)[0]}) > B  # k different draws of a prompt
    rewards = np.random.default_rng(1).integers(0, 4, (1, k * B)).astype(np.float32)
    rewards[0, 1::B] = 1.0  # prompt 1: every completion scores the same
    tokens, tmask = np.asarray(samples.tokens)[0], np.asarray(samples.mask)[0]
    eos = set(cfg.penalty_ids)
    has_eos = np.array([any(t in eos for t in row[m > 0]) for row, m in zip(tokens, tmask)])
    penalised = rewards[0] - 0.5 * ~has_eos
    pairs = []
    for b in range(B):
        s = [penalised[i * B + b] for i in range(k)]
        if max(s) > min(s):
            pairs.append((b, int(np.argmax(s)) * B + b, int(np.argmin(s)) * B + b))
    assert len(pairs) == B - 1 and 1 not in [b for b, _, _ in pairs]
    keep = [b for b, _, _ in pairs]
    rows = [r for _, r, _ in pairs] + [r for _, _, r in pairs]
    two = helpers.step_cfg(model, missing_eos_penalty=0.5)
    want, want_m = ts.jit_update(two, ts.init_state(two, params, jax.random.key(2)), params, ids[:, keep],
                                 mask[:, keep], jax.tree.map(lambda x: np.asarray(x)[:, rows], samples),
                                 rewards[:, rows])
    got, got_m = ts.jit_online_update(cfg, state, params, ids, mask, samples, rewards)
    for name in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
        np.testing.assert_allclose(float(got_m[name]), float(want_m[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    helpers.close_params(got.params, want.params, 1e-3, 1)
    assert float(got_m["frac_reward_zero_std"]) == pytest.approx(1 / B)
    spread = np.mean([penalised[r] - penalised[w] for _, r, w in pairs] + [0.0])
    np.testing.assert_allclose(float(got_m["objective/scores_spread"]), spread, rtol=1e-6)
    np.testing.assert_allclose(float(got_m["objective/scores_all"]), penalised.mean(), rtol=1e-6)


def test_two_random_completions_are_todays_step_and_k_random_pairs_are_reproducible(neox):
    """k = 2 with ``random`` is TRL's step bit for bit (the pairing changes nothing); k = 3 with ``random``: each
    prompt's pair is two of its own completions, drawn from the state's key and step (a resumed run draws the same)."""
    model, params = neox
    ids, mask = helpers.prompt_batch(model, 1, 4, seed=5)
    plain = helpers.step_cfg(model)
    explicit = dataclasses.replace(plain, pairing="random")
    samples = ts.jit_sample_completions(plain, ts.init_state(plain, params, jax.random.key(4)), ids, mask)
    rewards = np.random.default_rng(2).normal(size=(1, 8)).astype(np.float32)
    a, ma = ts.jit_online_update(plain, ts.init_state(plain, params, jax.random.key(4)), params, ids, mask, samples,
                                 rewards)
    b, mb = ts.jit_online_update(explicit, ts.init_state(explicit, params, jax.random.key(4)), params, ids, mask,
                                 samples, rewards)
    assert ma.keys() == mb.keys() and all(float(ma[n]) == float(mb[n]) for n in ma)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    three = helpers.step_cfg(model, num_generations=3, pairing="random")
    state = ts.init_state(three, params, jax.random.key(4))
    scores = np.zeros((2, 12), np.float32)
    rows, weights = (np.asarray(x) for x in ts.jit_pair_choice(three, state, scores))
    again = np.asarray(ts.jit_pair_choice(three, state, scores)[0])
    later = np.asarray(ts.jit_pair_choice(three, state.replace(step=state.step + 1), scores)[0])
    np.testing.assert_array_equal(rows, again)
    assert (rows % 4 == np.tile(np.arange(4), 2)).all() and (rows[:, :4] < rows[:, 4:]).all() and weights.all()
    assert not np.array_equal(rows, later) or not np.array_equal(rows[0], rows[1])


def test_a_judge_ranks_k_completions_by_a_round_robin(neox):
    """With a pairwise judge and k = 3, best_worst: the judge reads the 3 pairs of each prompt in one call, the
    completions are ranked by their mean chance of winning, and the pair is the most against the least winning, its
    verdict the round robin's; a prompt whose ranking ties has no pair (NaN verdict). Against a Python loop."""
    model, params = neox
    k, A, B = 3, 2, 2
    texts = [[["aaaa", "a", "aa"], ["bb", "bb", "bb"]], [["c", "ccc", "cc"], ["dddd", "d", "ddd"]]]  # [a][b][i]
    calls = []

    class Shorter:  # prefers the shorter completion; a tie is 0.5
        def preferences(self, prompts, first, second):
            calls.append(len(first))
            return np.array([0.5 if len(x) == len(y) else float(len(x) < len(y)) for x, y in zip(first, second)])

    flat = np.array([texts[a][b][i] for a in range(A) for i in range(k) for b in range(B)], object)  # [A, k, B]
    cfg = helpers.step_cfg(model, num_generations=k)
    run = types.SimpleNamespace(step_cfg=cfg, judge=Shorter(), decode=lambda tokens: list(flat),
                                train=types.SimpleNamespace(prompts=["p0", "p1", "p2", "p3"]),
                                steps=types.SimpleNamespace(pair_choice=ts.jit_pair_choice))
    state = ts.init_state(cfg, params, jax.random.key(0))
    verdicts, rows, metrics = loop.judge_samples(run, state, np.arange(A * B), np.zeros((A, k * B, 1), np.int32))
    assert calls == [A * B * 3]
    for a in range(A):
        for b in range(B):
            lengths = [len(t) for t in texts[a][b]]
            wins = [np.mean([0.5 if lengths[i] == lengths[j] else float(lengths[i] < lengths[j])
                             for j in range(k) if j != i]) for i in range(k)]
            best, worst = int(np.argmax(wins)), int(np.argmin(wins))
            if wins[best] == wins[worst]:
                assert np.isnan(verdicts[a, b]) and np.isnan(verdicts[a, B + b])
                continue
            assert (rows[a, b], rows[a, B + b]) == (best * B + b, worst * B + b)
            assert verdicts[a, b] == (0.5 if lengths[best] == lengths[worst] else float(lengths[best] < lengths[worst]))
            assert verdicts[a, B + b] == 1.0 - verdicts[a, b]
    assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 4)  # prompt (0, 1): three equal completions

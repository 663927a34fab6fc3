"""The two-model sampler of TRL's online family (``sampling.sample_pair``: XPO's reference completions, Nash-MD's
geometric mixture) against a Python loop over full forwards of both models, the mixed logits chosen step by step; on
the plain decoder, the hybrid Qwen3.5 cache and LoRA (the reference is the policy with its adapters off). Greedy
mixture decoding against TRL 1.12's GeometricMixtureWrapper is in test_trl112.py (recorded in tests/golden)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import sampling
from jodpo.models import lora
from tests import hf_fixtures

_sample_pair = jax.jit(sampling.sample_pair, static_argnums=(0, 6))
_logits = jax.jit(jodpo.logits, static_argnums=0)


def perturbed(params, seed: int, scale: float = 0.02):
    """Another model of the same shapes: every float weight moved by a little noise."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                     if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)])


def pair_reference(model, params, ref_params, ids, mask, rng, cfg, coef):
    """``sample_pair`` as a Python loop: at step t, full forwards of both models over the prompts and the tokens so
    far (right-padded to one length: one compile), block 0 from the policy's last logits, block 1 from the
    reference's (coef None) or log_softmax(coef * ref + (1 - coef) * policy), chosen as the sampler chooses."""
    B, P = ids.shape
    T, keys = cfg.max_new_tokens, sampling.completion_keys(rng, jnp.arange(B), 2)
    full_ids = np.concatenate([np.tile(ids, (2, 1)), np.full((2 * B, T), cfg.pad_token_id, np.int32)], 1)
    full_mask = np.concatenate([np.tile(mask, (2, 1)), np.zeros((2 * B, T), np.int32)], 1)
    seen = np.zeros((2 * B, model.vocab_size), bool)
    for b in range(2 * B):
        seen[b, full_ids[b, :P][full_mask[b, :P] > 0]] = True
    done = np.zeros(2 * B, bool)
    tokens, out_mask, logprobs = (np.zeros((2 * B, T), dt) for dt in (np.int32, np.int32, np.float32))
    for t in range(T):
        pol = np.asarray(_logits(model, params, full_ids, full_mask))[:, P + t - 1]
        ref = np.asarray(_logits(model, ref_params, full_ids, full_mask))[:, P + t - 1]
        second = ref[B:] if coef is None else np.asarray(jax.nn.log_softmax(coef * ref[B:] + (1 - coef) * pol[B:]))
        token, logp = sampling.choose(jnp.asarray(np.concatenate([pol[:B], second])),
                                      jnp.asarray(seen) if cfg.repetition_penalty != 1.0 else None,
                                      sampling.token_keys(keys, jnp.full((2 * B,), t)), cfg)
        token, logp, alive = np.asarray(token), np.asarray(logp), ~done
        tokens[:, t] = np.where(alive, token, cfg.pad_token_id)
        out_mask[:, t], logprobs[:, t] = alive, np.where(alive, logp, 0.0)
        full_ids[:, P + t], full_mask[:, P + t] = tokens[:, t], alive
        seen[np.arange(2 * B)[alive], token[alive]] = True
        done |= alive & np.isin(token, cfg.eos_token_ids)
    return tokens, out_mask, logprobs


CASES = {  # (family, LoRA policy, mixture coefficient, sampling settings)
    "nash_md": ("neox", False, 0.5, dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2)),
    "xpo": ("llama", False, None, dict(temperature=1.0)),
    "nash_md_qwen3_5": ("qwen3_5", False, 0.3, dict(temperature=0.8, min_p=0.02)),
    "nash_md_lora_greedy": ("llama", True, 0.7, dict(temperature=0.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_pair_sampler_equals_a_python_loop_over_full_forwards(checkpoints, case):
    family, use_lora, coef, settings = CASES[case]
    model, base = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    if use_lora:  # the policy: the base with adapters (moved off their zero start); the reference: the base alone
        model = model.replace(lora_rank=4, lora_alpha=8.0)
        adapters = lora.init_adapters(model, lora.resolve_targets(model, None), jax.random.key(1))
        params, ref_params = lora.attach(base, perturbed(adapters, 2, 0.3)), base
    else:
        params, ref_params = base, perturbed(base, 3)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(8), [6, 3, 5], model.pad_token_id, "left")
    cfg = jodpo.SamplingConfig(max_new_tokens=7, eos_token_ids=(5, 9, 17), pad_token_id=model.pad_token_id, chunk=3,
                               **settings)
    rng = jax.random.key(11)
    tokens, out_mask, logprobs = pair_reference(model, params, ref_params, ids, mask, rng, cfg, coef)
    for slots in (0, 2):  # all three prompts in flight; two, the third taking the first slot that ends (refill)
        got = _sample_pair(model, params, ref_params, ids, mask, rng, dataclasses.replace(cfg, slots=slots), coef)
        np.testing.assert_array_equal(np.asarray(got.tokens), tokens)
        np.testing.assert_array_equal(np.asarray(got.mask), out_mask)
        np.testing.assert_allclose(np.asarray(got.logprobs), logprobs, rtol=1e-4, atol=1e-5)
    # the two blocks differ (the second model, or the mixture, really decides block 1)
    assert not np.array_equal(tokens[:3], tokens[3:])


def test_mixture_coefficient_is_traced_and_its_ends_are_the_two_models(checkpoints):
    """One compiled sampler for every coefficient (a schedule changes it per epoch without a recompile); at c = 0 the
    greedy mixture block is the policy's, at c = 1 the reference's (log_softmax shifts logits by a constant)."""
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    ref_params = perturbed(params, 4, 0.05)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(9), [4, 6], model.pad_token_id, "left")
    cfg = jodpo.SamplingConfig(max_new_tokens=6, temperature=0.0, pad_token_id=model.pad_token_id)
    rng = jax.random.key(0)
    before = _sample_pair._cache_size()
    ends = [np.asarray(_sample_pair(model, params, ref_params, ids, mask, rng, cfg, jnp.float32(c)).tokens)
            for c in (0.0, 1.0)]
    assert _sample_pair._cache_size() == before + 1
    xpo = np.asarray(_sample_pair(model, params, ref_params, ids, mask, rng, cfg, None).tokens)
    np.testing.assert_array_equal(ends[0][2:], ends[0][:2])  # c = 0: the policy in both blocks
    np.testing.assert_array_equal(ends[1][2:], xpo[2:])  # c = 1: the reference's completions
    assert not np.array_equal(xpo[:2], xpo[2:])

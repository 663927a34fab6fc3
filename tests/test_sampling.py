"""The sampler against transformers' generate, a Python loop, and the exact filtered distribution."""
import dataclasses
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo import filtering, sampling
from jodpo.models import decoder, heads
from jodpo.models import params as mparams
from tests import hf_fixtures
from tests import helpers

_sample = jax.jit(sampling.sample, static_argnums=(0, 5))


def sample_reference(model, params, prompt_ids, prompt_mask, rng, config, keys=None):
    """The sampler as a plain Python loop, one jitted step at a time; row b draws token t from
    ``token_keys(keys, t)`` (by default each row's own prompt's: ``completion_keys``)."""
    B, P = prompt_ids.shape
    keys = sampling.completion_keys(rng, jnp.arange(B), 1) if keys is None else keys
    T = config.max_new_tokens
    step = jax.jit(decoder.hidden_states, static_argnums=0)
    cache = decoder.init_cache(model, B, P + T)
    h, cache = step(model, params, prompt_ids, prompt_mask, cache)
    logits = heads.lm_head(model, params, h[:, -1])
    seen = np.zeros((B, model.vocab_size), bool)
    for b in range(B):
        seen[b, np.asarray(prompt_ids)[b][np.asarray(prompt_mask)[b] > 0]] = True
    done = np.zeros(B, bool)
    tokens, mask, logprobs = (np.zeros((B, T), dt) for dt in (np.int32, np.int32, np.float32))
    for t in range(T):
        token, logp = sampling.choose(logits, jnp.asarray(seen) if config.repetition_penalty != 1.0 else None,
                             sampling.token_keys(keys, jnp.full((B,), t)), config)
        token, logp = np.asarray(token), np.asarray(logp)
        alive = ~done
        tokens[:, t] = np.where(alive, token, config.pad_token_id)
        mask[:, t] = alive
        logprobs[:, t] = np.where(alive, logp, 0.0)
        seen[np.arange(B)[alive], token[alive]] = True
        done |= alive & np.isin(token, config.eos_token_ids)
        if done.all():
            break
        h, cache = step(model, params, jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(alive[:, None].astype(np.int32)),
                        cache)
        logits = heads.lm_head(model, params, h[:, -1])
    return sampling.Samples(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), logprobs=jnp.asarray(logprobs))


@pytest.mark.parametrize("family", hf_fixtures.FAMILIES)
def test_greedy_equals_transformers_generate(checkpoints, family):
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(5), [9, 4, 7], model.pad_token_id, "left")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    T = 10

    def generate(eos):
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                              do_sample=False, max_new_tokens=T, eos_token_id=eos, pad_token_id=model.pad_token_id)
        return out[:, ids.shape[1]:].numpy()

    free = generate(eos=[])  # no EOS: choose a token row 0 emits mid-way, so that row ends there
    eos = int(free[0, 4])
    want = generate(eos=[eos])
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.0, eos_token_ids=(eos,),
                               pad_token_id=model.pad_token_id, chunk=3)
    got = _sample(model, params, ids, mask, jax.random.key(0), cfg)
    tokens = np.asarray(got.tokens)
    want = np.pad(want, ((0, 0), (0, T - want.shape[1])), constant_values=model.pad_token_id)
    np.testing.assert_array_equal(tokens, want)
    first_eos = list(tokens[0]).index(eos)
    assert np.asarray(got.mask)[0].tolist() == [1] * (first_eos + 1) + [0] * (T - first_eos - 1)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4"])
def test_sliding_layers_keep_their_window_and_decode_as_transformers_past_it(checkpoints, family):
    """A sliding layer's cache is a ring of its window's slots (4 or 5 here) whatever the length, the full layers' as
    long as the sequence. Greedy decoding of 24 tokens after prompts longer and shorter than the window (the ring
    wrapped several times; Gemma 4's KV-sharing layer reading the ring of the sliding layer before it) equals
    transformers' generate, for one completion a prompt and for two from one prefill (the prompt's cache tiled)."""
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(8), [11, 2, 6], model.pad_token_id, "left")
    T, (B, P), W = 24, ids.shape, model.sliding_window
    assert 4 <= W < P
    states = decoder.init_cache(model, B, P + T)["state"]
    full = "global_attention" if family == "gemma4" else "attention"
    ring = states["sliding_attention"]
    assert ring["k"].shape == ring["v"].shape == (len(model.layers_of("sliding_attention")), B, model.num_kv_heads, W,
                                                  model.head_dim)
    assert states[full]["k"].shape[-2] == P + T
    per_layer = decoder.init_cache(model, B, P + T, per_layer=True)["state"]
    assert [s["k"].shape[2] for s in per_layer if s is not None] == [
        W if k == "sliding_attention" else P + T for k in model.kinds if k not in decoder.READS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                           do_sample=False, max_new_tokens=T, eos_token_id=[], pad_token_id=model.pad_token_id)
    want = want[:, P:].numpy()
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.0, eos_token_ids=(), pad_token_id=model.pad_token_id,
                               chunk=5)
    one = _sample(model, params, ids, mask, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(one.tokens), want)
    two = jax.jit(jodpo.sample, static_argnums=(0, 5, 6))(model, params, ids, mask, jax.random.key(0), cfg, 2)
    np.testing.assert_array_equal(np.asarray(two.tokens), np.concatenate([want, want]))


@pytest.mark.parametrize("cfg", [
    dict(temperature=0.9, unroll=2),  # two decode steps a scan iteration: the same draws
    dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
    dict(temperature=1.0, min_p=0.05),
])
def test_scan_sampler_equals_python_loop(checkpoints, cfg):
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(6), [6, 3, 8, 2], model.pad_token_id, "left")
    config = jodpo.SamplingConfig(max_new_tokens=12, eos_token_ids=(5, 9, 17), pad_token_id=model.pad_token_id,
                                  chunk=5, **cfg)
    rng = jax.random.key(42)
    got = _sample(model, params, ids, mask, rng, config)
    ref = sample_reference(model, params, ids, mask, rng, config)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-6)


def test_num_samples_copies_the_prompt_cache_and_equals_repeated_prompts(checkpoints):
    """One prefill for two samples per prompt gives what sampling the repeated prompts gives (block layout), each
    row drawing from its (prompt, sample) keys."""
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(7), [6, 3, 8], model.pad_token_id, "left")
    config = jodpo.SamplingConfig(max_new_tokens=10, temperature=0.9, repetition_penalty=1.2, eos_token_ids=(5,),
                                  pad_token_id=model.pad_token_id, chunk=4)
    rng = jax.random.key(3)
    got = jax.jit(jodpo.sample, static_argnums=(0, 5, 6))(model, params, ids, mask, rng, config, 2)
    ref = sample_reference(model, params, np.concatenate([ids, ids]), np.concatenate([mask, mask]), rng, config,
                           keys=sampling.completion_keys(rng, jnp.arange(3), 2))
    assert got.tokens.shape == (6, 10)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(np.asarray(got.tokens[:3]), np.asarray(got.tokens[3:]))  # two different draws


@pytest.mark.parametrize("family", ["gemma4", "qwen3_5"])
def test_refill_between_chunks_gives_the_fixed_batch_completions(checkpoints, family):
    """With fewer prompts in flight than the call's (``SamplingConfig.slots``), the rows whose completions have ended
    take the next prompts between chunks, and every completion is the one a fixed batch of as many prompts samples,
    token for token: each prompt prefilled in the same batches (the stash), written into its rows at slot P (the
    caches' index per row), the sliding ring, KV sharing's reads (Gemma 4) and the DeltaNet state and convolution window
    (Qwen3.5) reset, its draws keyed by (prompt, sample)."""
    model, params = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(12), [6, 3, 8, 2, 7, 4], model.pad_token_id, "left")
    B, T, n, S = ids.shape[0], 12, 2, 2
    fixed = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.9, repetition_penalty=1.2, chunk=2,
                                 eos_token_ids=tuple(range(3, 300, 13)), pad_token_id=model.pad_token_id)
    sample = jax.jit(jodpo.sample, static_argnums=(0, 5, 6))
    got = sample(model, params, ids, mask, jax.random.key(5), dataclasses.replace(fixed, slots=S), n)
    parts = [sample(model, params, ids[b:b + S], mask[b:b + S], jax.random.key(5), fixed, n, b) for b in range(0, B, S)]
    want = {k: np.concatenate([np.asarray(getattr(o, k)).reshape(n, S, T) for o in parts], 1).reshape(n * B, T)
            for k in ("tokens", "mask", "logprobs")}
    lengths = want["mask"].sum(1)
    assert lengths.min() < T // 2 and lengths.max() == T  # short and long completions
    np.testing.assert_array_equal(np.asarray(got.tokens), want["tokens"])
    np.testing.assert_array_equal(np.asarray(got.mask), want["mask"])
    np.testing.assert_allclose(np.asarray(got.logprobs), want["logprobs"], rtol=1e-5, atol=1e-5)
    whole = sample(model, params, ids, mask, jax.random.key(5), fixed, n)  # all at once: the same draws (only the
    assert np.mean(np.asarray(whole.tokens) == want["tokens"]) > 0.9  # prefill's batch rounds differently)
    steps = int(got.decode_steps[0])
    made = lengths.sum() - n * B  # real decoded tokens over row-steps
    np.testing.assert_allclose(sampling.slot_utilization(got, n * S), made / (steps * n * S))


def test_logprobs_are_raw_model_logprobs(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(7), [5, 3], model.pad_token_id, "left")
    cfg = jodpo.SamplingConfig(max_new_tokens=6, temperature=0.5, top_k=10, pad_token_id=model.pad_token_id)
    out = _sample(model, params, ids, mask, jax.random.key(1), cfg)
    full_ids = np.concatenate([ids, np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([mask, np.asarray(out.mask)], 1)
    logp = jax.nn.log_softmax(jodpo.logits(model, params, full_ids, full_mask), -1)
    P = ids.shape[1]
    want = np.take_along_axis(np.asarray(logp[:, P - 1:-1]), np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), want * np.asarray(out.mask), rtol=1e-4, atol=1e-5)


def _filtered_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """transformers' warpers written out in numpy, for one row."""
    x = logits / temperature
    if top_k:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    if top_p < 1:
        order = np.argsort(x)
        p = np.exp(x[order] - x.max()); p /= p.sum()
        remove = np.cumsum(p) <= 1 - top_p
        remove[-1] = False
        x = x.copy(); x[order[remove]] = -np.inf
    if min_p:
        p = np.exp(x - x.max()); p /= p.sum()
        x = np.where(p < min_p * p.max(), -np.inf, x)
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.mark.parametrize("filters", [dict(temperature=0.6), dict(temperature=1.3, top_k=5),
                                     dict(temperature=0.8, top_p=0.7), dict(temperature=1.0, min_p=0.15)])
def test_empirical_frequencies_match_filtered_distribution(filters):
    model = decoder.Model(family="llama", task="causal_lm", vocab_size=12, hidden_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=4, mlp=decoder.MLP(8, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                       qkv_bias=False, out_bias=False, parallel_residual=False,
                       rope=decoder.Rope(4, (1.0, 0.01)), tie_embeddings=False)
    params = mparams.init_params(model, jax.random.key(0), std=1.0)
    N = 40000
    ids, mask = np.full((N, 2), 3, np.int32), np.ones((N, 2), np.int32)
    cfg = jodpo.SamplingConfig(max_new_tokens=1, **filters)
    tokens = np.asarray(_sample(model, params, ids, mask, jax.random.key(3), cfg).tokens[:, 0])
    freq = np.bincount(tokens, minlength=model.vocab_size) / N
    logits = np.asarray(jodpo.logits(model, params, ids[:1], mask[:1])[0, -1], np.float64)
    want = _filtered_distribution(logits, **filters)
    tv = 0.5 * np.abs(freq - want).sum()
    assert tv < 0.015, (tv, freq, want)
    assert np.all(freq[want == 0] == 0)  # filtered tokens never appear
    plain = _filtered_distribution(logits, 1.0)
    assert 0.5 * np.abs(plain - want).sum() > 0.05  # the check can tell the filters apart


@pytest.mark.parametrize("block", [128, 7])
def test_two_level_inverse_cdf_draws_the_distribution_across_blocks(block):
    """The draw's block search and in-block search, on a vocabulary of several blocks (not a multiple of the
    block: padded): frequencies match, filtered tokens and the padding are never drawn."""
    V, N = 1000, 40000
    rng = np.random.default_rng(5)
    x = rng.normal(size=V) * 3.0
    x[rng.random(V) < 0.5] = -np.inf  # filtered out
    x[V - 1] = 2.0  # the last token is allowed (it sits next to the padding)
    want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    keys = jax.random.split(jax.random.key(7), N // 8)
    draw = jax.jit(jax.vmap(lambda k: filtering._inverse_cdf(jnp.tile(jnp.asarray(x, jnp.float32), (8, 1)), k, block)))
    tokens = np.asarray(draw(keys)).ravel()
    assert tokens.min() >= 0 and tokens.max() < V
    freq = np.bincount(tokens, minlength=V) / N
    assert np.all(freq[want == 0] == 0)
    tv = 0.5 * np.abs(freq - want).sum()
    assert tv < 0.03, tv  # sampling noise at N=40000 here: about 0.02
    # A uniform that rounds to the row's total (u = 1) still lands on the last allowed token, not past it.
    with mock.patch.object(jax.random, "uniform", lambda key, shape, dtype: jnp.ones(shape, dtype)):
        edge = filtering._inverse_cdf(jnp.asarray(np.where(np.arange(V) < V - 300, x, -np.inf), jnp.float32)[None],
                                     jax.random.key(0), block)
    assert int(edge[0]) == np.flatnonzero(np.isfinite(x[:V - 300]))[-1]


def test_stops_early_and_pads_after_eos(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["qwen2"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(8), [4, 4], model.pad_token_id, "left")
    every_token = tuple(range(model.vocab_size))  # every token is an EOS: each row ends at step 0
    cfg = jodpo.SamplingConfig(max_new_tokens=40, temperature=1.0, eos_token_ids=every_token,
                               pad_token_id=model.pad_token_id, chunk=4)
    out = _sample(model, params, ids, mask, jax.random.key(0), cfg)
    assert np.asarray(out.mask).sum(1).tolist() == [1, 1]
    assert np.all(np.asarray(out.tokens)[:, 1:] == model.pad_token_id)
    assert np.all(np.asarray(out.logprobs)[:, 1:] == 0)


def test_same_bucket_does_not_recompile(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))

    @jax.jit
    @chex.assert_max_traces(n=2)  # one trace per bucket (8 and 16), none for the repeated bucket: a third raises
    def f(params, ids, mask, rng):
        return sampling.sample(model, params, ids, mask, rng, jodpo.SamplingConfig(max_new_tokens=4))

    rng = np.random.default_rng(9)
    for lengths in ([3, 7], [10, 2], [5, 5]):
        ids, mask = hf_fixtures.padded_batch(rng, lengths, model.pad_token_id, "left")
        ids, mask = sampling.pad_to_bucket(ids, mask, (8, 16), model.pad_token_id)
        assert ids.shape == (2, 8 if max(lengths) <= 8 else 16)
        f(params, ids, mask, jax.random.key(0)).tokens.block_until_ready()


def test_bucket_errors_and_config_validation():
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        sampling.bucket_length(40, (16, 32))
    with pytest.raises(ValueError, match="top_p"):
        jodpo.SamplingConfig(top_p=0.0)
    assert hash(jodpo.SamplingConfig(eos_token_ids=[1, 2])) == hash(jodpo.SamplingConfig(eos_token_ids=(1, 2)))


def test_decode_loop_converts_no_weights(checkpoints):
    """bf16 compute on float32 master weights: the weights are cast once per sampling call, before the decode
    loop, not on each of its steps (which would read every weight twice and convert it, max_new_tokens times)."""
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    model = model.replace(dtype="bfloat16")
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [5, 3], model.pad_token_id, "left")
    config = jodpo.SamplingConfig(max_new_tokens=4, eos_token_ids=(5,), pad_token_id=model.pad_token_id)
    weights = {x.shape[1:] for x in jax.tree.leaves(params["layers"])} | {x.shape for x in jax.tree.leaves(params)}
    jaxpr = jax.make_jaxpr(lambda p: jodpo.sample(model, p, ids, mask, jax.random.key(0), config, 2))(params)
    converts = helpers.loop_converts(jaxpr)
    assert not [s for s in converts if s in weights], converts
    # the check sees converts in loops: the plain forward in a loop converts its weights on every step
    looped = jax.make_jaxpr(lambda p: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (
        c[0] + 1, c[1] + jodpo.logits(model, p, ids, mask).sum()), (0, 0.0)))(params)
    assert [s for s in helpers.loop_converts(looped) if s in weights]


def test_compute_params_change_no_number(checkpoints):
    for family in ("neox", "llama"):  # LayerNorm (float32 scale and bias) and RMSNorm
        model, params = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
        model = model.replace(dtype="bfloat16")
        ids, mask = hf_fixtures.padded_batch(np.random.default_rng(1), [6, 4], model.pad_token_id, "left")
        cast = mparams.compute_params(model, params)
        assert cast["embed"].dtype == jnp.bfloat16 and jax.tree.leaves(cast["final_norm"])[0].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(jodpo.logits(model, params, ids, mask)),
                                      np.asarray(jodpo.logits(model, cast, ids, mask)))

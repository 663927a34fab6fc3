"""Splash attention for the forwards (jodpo.models.splash, in Pallas' interpret mode on the CPU): equal to jodpo's XLA
attention with the forwards' masks (padding, causality, windows, the shared prompt's offset), values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodpo.models import decoder, layers
from jodpo.models import params as mparams
from jodpo.models.splash import splash_attention

TOL = 2e-2  # bf16: a few of its ulps at these magnitudes


def _model(**kw):
    return decoder.Model(family="llama", task="causal_lm", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp=decoder.MLP(8, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                         qkv_bias=False, out_bias=False, parallel_residual=False,
                         rope=decoder.Rope(8, (1.0, 0.1, 0.01, 0.001)), tie_embeddings=False, dtype="bfloat16", **kw)


def test_splash_equals_xla_attention_and_its_gradients():
    """Left and right padding among the keys, grouped kv heads, a prompt's completion (offset: its slots follow the
    prompt's 4) in a window of 3, soft-capped, scaled: the outputs of the queries that see a key, and the gradients."""
    model, offset, window = _model(attn_softcap=5.0, query_scale=0.3), 4, 3
    rng = np.random.default_rng(0)
    B, L = 2, 6
    S = L + offset
    q = jnp.asarray(rng.normal(size=(B, L, 4, 8)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(B, S, 2, 8)), jnp.bfloat16) for _ in range(2))
    keys = np.ones((B, S), bool)
    keys[0, :2], keys[1, -1] = False, False
    keys = jnp.asarray(keys)
    dist = (offset + np.arange(L))[:, None] - np.arange(S)[None]
    attend = keys[:, None, :] & jnp.asarray(layers.within(window, dist))
    sees = np.asarray(attend.any(-1))
    w = jnp.asarray(rng.normal(size=(B, L, 4, 8)), jnp.float32) * jnp.asarray(sees, jnp.float32)[:, :, None, None]

    def xla(q, k, v):
        return layers.attention(model, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), attend)

    def splash(q, k, v):
        return splash_attention(model, q, k, v, keys, offset, window)

    got, want = np.asarray(splash(q, k, v), np.float32), np.asarray(xla(q, k, v), np.float32)
    np.testing.assert_allclose(got[sees], want[sees], rtol=TOL, atol=TOL)
    for f in (xla, splash):
        f.grads = jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(splash.grads, xla.grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=TOL, atol=TOL)


def test_the_shared_prompt_forward_with_splash_equals_xla():
    """A prompt's completions in the shared-prompt layout (prefixed_hidden_states) through a sliding layer and a full
    one, left and right padding: splash attention's hidden states at the real tokens are as close to float32's as
    the XLA attention's in bf16 are (bf16's rounding through two layers and the final norm)."""
    model = _model(layer_kinds=("sliding_attention", "attention"), sliding_window=3)
    params = mparams.init_params(model, jax.random.key(0), std=0.5)
    rng = np.random.default_rng(1)
    prefix, pmask = jnp.asarray(rng.integers(1, 32, (2, 5)), jnp.int32), jnp.asarray([[0, 0, 1, 1, 1], [1] * 5])
    suffix, smask = jnp.asarray(rng.integers(1, 32, (4, 3)), jnp.int32), jnp.asarray([[1, 1, 0], [1] * 3] * 2)
    real = np.asarray(jnp.concatenate([jnp.concatenate([pmask] * 2), smask], 1), bool)

    def hidden(m):
        return np.asarray(decoder.prefixed_hidden_states(m, params, prefix, pmask, suffix, smask), np.float32)[real]

    splash = model.replace(attention="splash")
    assert "pallas_call" in str(jax.make_jaxpr(  # splash is what runs
        lambda p: decoder.prefixed_hidden_states(splash, p, prefix, pmask, suffix, smask))(params))
    exact = hidden(model.replace(dtype="float32"))
    xla_error, splash_error = np.abs(hidden(model) - exact).max(), np.abs(hidden(splash) - exact).max()
    assert splash_error <= 1.5 * xla_error, (splash_error, xla_error)

"""The decode steps' Pallas kernel (jodpo.models.decode_attention, in Pallas' interpret mode on the CPU): equal to
jodpo's XLA attention over the slots a row attends to, wherever they sit, reading only the blocks that hold one."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo.models import decode_attention as da
from jodpo.models import decoder, layers
from jodpo.models import params as mparams


def _model(dtype="float32", **kw):
    return decoder.Model(family="llama", task="causal_lm", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp=decoder.MLP(8, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                         qkv_bias=False, out_bias=False, parallel_residual=False,
                         rope=decoder.Rope(8, (1.0, 0.1, 0.01, 0.001)), tie_embeddings=False, dtype=dtype, **kw)


def _masks(S: int) -> np.ndarray:
    """Rows of every layout a cache can hold: scattered slots, a ring's wrapped run, a single slot, every slot, a run
    ending in the partial last block, none (a finished row)."""
    rng = np.random.default_rng(1)
    m = np.zeros((6, S), bool)
    m[0] = rng.random(S) < 0.3
    m[1, S - 5:], m[1, :3] = True, True  # a ring's tokens, wrapped past the slab's end
    m[2, 9] = True
    m[3] = True
    m[4, 13:] = True
    return m


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-6), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("options", [{}, dict(attn_softcap=5.0, query_scale=0.3)])
def test_the_kernel_equals_xla_attention_over_any_slots(dtype, tol, options):
    """One query a row, grouped kv heads, blocks of 8 over 21 slots (the last block partial), per layer and a layer of
    a stack read in place; a row that attends to nothing gets zeros."""
    model = _model(dtype, **options)
    rng = np.random.default_rng(0)
    S = 21
    attend = jnp.asarray(_masks(S))[:, None]
    B = attend.shape[0]
    q = jnp.asarray(rng.normal(size=(B, 1, 4, 8)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(3, B, 2, S, 8)), dtype) for _ in range(2))
    want = np.asarray(layers.attention(model, q, k[1], v[1], attend), np.float32)
    for got in (da.decode_attention(model, q, k[1], v[1], attend, block=8),
                jax.jit(lambda q, k, v, a, j: da.decode_attention(model, q, k, v, a, j, block=8))(
                    q, k, v, attend, jnp.int32(1))):
        got = np.asarray(got, np.float32)
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=tol, atol=tol)
        assert np.all(got[-1] == 0)


def test_each_occupied_block_is_fetched_once_and_nothing_else():
    """The grid's fetch tables: a step that computes fetches the block it computes; the pipeline copies a block when
    the fetched (row, block) changes, so the copies are exactly the occupied blocks (a finished row: none)."""
    bs, attend = 4, _masks(21)
    count, blocks, rows, fetch = (np.asarray(a) for a in da.fetch_tables(jnp.asarray(attend), bs))
    B, n = blocks.shape
    occupied = [{i // bs for i in np.flatnonzero(attend[b])} for b in range(B)]
    assert list(count) == [len(o) for o in occupied]
    copies = []
    for b in range(B):
        for j in range(n):
            if j < count[b]:
                assert rows[b, j] == b and fetch[b, j] == sorted(occupied[b])[j]
            here = (int(rows[b, j]), int(fetch[b, j]))
            if not copies or copies[-1] != here:
                copies.append(here)
    assert copies == [(b, i) for b in range(B) for i in sorted(occupied[b])]


def test_sampling_with_the_kernel_equals_xla():
    """Greedy sampling through a sliding-window layer (its ring) and a full one, soft-capped, left padding: the same
    tokens and log-probs with the kernel as with the XLA attention (the kernel only on the decode steps)."""
    model = _model(layer_kinds=("sliding_attention", "attention"), sliding_window=4, attn_softcap=20.0)
    params = mparams.init_params(model, jax.random.key(0), std=0.5)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 32, (3, 6)), jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1]], jnp.int32)
    cfg = jodpo.SamplingConfig(max_new_tokens=10, temperature=0.0)
    a = jodpo.sample(model, params, ids, mask, jax.random.key(1), cfg)
    b = jodpo.sample(model.replace(decode_attention="pallas"), params, ids, mask, jax.random.key(1), cfg)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    # the refill's rows (a cache index per row, rows that start again at slot P) through the kernel: the same
    refill = dataclasses.replace(cfg, slots=1, eos_token_ids=(int(a.tokens[0, 3]),))
    c, d = (jodpo.sample(m, params, ids, mask, jax.random.key(1), refill) for m in (model, model.replace(
        decode_attention="pallas")))
    np.testing.assert_array_equal(c.tokens, d.tokens)
    np.testing.assert_allclose(c.logprobs, d.logprobs, atol=2e-5)


def test_a_stacked_cache_decodes_with_the_kernel_as_with_xla():
    """The decoder's scanned layers over a stacked cache: the kernel reads each layer's slab out of the stack."""
    model = _model()
    params = mparams.init_params(model, jax.random.key(2), std=0.5)
    ids, mask = jnp.asarray([[3, 5, 7, 9], [0, 2, 4, 6]], jnp.int32), jnp.asarray([[1, 1, 1, 1], [0, 1, 1, 1]])

    def two_steps(m):
        _, cache = decoder.hidden_states(m, params, ids, mask, decoder.init_cache(m, 2, 7), empty_cache=True)
        for t in (11, 13):
            h, cache = decoder.hidden_states(m, params, jnp.full((2, 1), t), jnp.ones((2, 1), jnp.int32), cache)
        return h

    pallas = model.replace(decode_attention="pallas")
    assert "pallas_call" in str(jax.make_jaxpr(lambda: two_steps(pallas))())  # the kernel is what ran
    np.testing.assert_allclose(two_steps(pallas), two_steps(model), atol=2e-6)


def test_an_unknown_decode_attention_is_refused():
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        _model(decode_attention="flash")


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jodpo.models import layers
from jodpo.parallel import sharding as S
from jodpo.models import decoder
model = decoder.Model(family="llama", task="causal_lm", vocab_size=32, hidden_size=16, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, mlp=decoder.MLP(8, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                      qkv_bias=False, out_bias=False, parallel_residual=False, rope=decoder.Rope(8, (1.0,) * 4),
                      tie_embeddings=False, decode_attention="pallas")
mesh = S.make_mesh(2, 1, 2)  # rows over data, kv heads over tensor
rng = np.random.default_rng(0)
attend = jnp.asarray(rng.random((4, 1, 21)) < 0.4).at[3].set(False)  # scattered slots; a row with none
q = jnp.asarray(rng.normal(size=(4, 1, 4, 8)), jnp.float32)
k, v = (jnp.asarray(rng.normal(size=(4, 2, 21, 8)), jnp.float32) for _ in range(2))
on = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
args = on(q, "data", None, "tensor"), on(k, "data", "tensor"), on(v, "data", "tensor"), on(attend, "data")
run = jax.jit(lambda *a: layers.cache_attention(model, *a))
assert "shard_map" in str(jax.make_jaxpr(run)(*args))
got, want = np.asarray(run(*args)), np.asarray(layers.attention(model, q, k, v, attend))
np.testing.assert_allclose(got[:3], want[:3], atol=2e-6)
assert np.all(got[3] == 0)
# splash attention (the forwards'), token-major, bf16, a window of 3, the first row's first two keys padding
model = model.replace(attention="splash", dtype="bfloat16")
q = jnp.asarray(rng.normal(size=(4, 6, 4, 8)), jnp.bfloat16)
k, v = (x[:, :, :6].astype(jnp.bfloat16).transpose(0, 2, 1, 3) for x in (k, v))  # [B, S, K, Dh]
keys = jnp.ones((4, 6), bool).at[0, :2].set(False)
args = on(q, "data", None, "tensor"), on(k, "data", None, "tensor"), on(v, "data", None, "tensor"), on(keys, "data")
run = jax.jit(lambda *a: layers.causal_attention(model, *a, 0, 3))
assert "shard_map" in str(jax.make_jaxpr(run)(*args))
got = np.asarray(run(*args), np.float32)
want = np.asarray(layers.causal_attention(model.replace(attention="xla"), q, k, v, keys, 0, 3), np.float32)
np.testing.assert_allclose(got[0, 2:], want[0, 2:], atol=2e-2)  # the queries that see a key
np.testing.assert_allclose(got[1:], want[1:], atol=2e-2)
"""


def test_on_a_mesh_the_kernels_run_per_device_as_xla_does():
    """On 4 CPU devices (rows split over data, kv heads over tensor) the decode kernel and splash attention
    (jodpo.models.splash) run in a shard_map, each device its rows and heads (XLA cannot partition a Pallas kernel),
    and give what the XLA attention gives."""
    import subprocess
    import sys

    from tests.subproc import ROOT, cpu_env

    subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=cpu_env(4), cwd=ROOT, check=True, timeout=300)

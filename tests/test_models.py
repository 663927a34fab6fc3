"""jodpo's decoders against transformers (fp32, eager attention) for every family variant."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import jodpo
from jodpo.models import decoder, heads, layers
from jodpo.models import params as mparams
from tests import hf_fixtures, references

LENGTHS = [12, 5, 9, 1]


def _hf(cls, path):
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _positions(mask):
    return np.maximum(np.cumsum(mask, -1) - 1, 0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", hf_fixtures.FAMILIES)
def test_logits_match_transformers(checkpoints, family, side):
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), LENGTHS, model.pad_token_id, side)
    ours = np.asarray(jax.jit(jodpo.logits, static_argnums=0)(model, params, ids, mask))
    with torch.no_grad():
        ref = _hf(AutoModelForCausalLM, path)(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.numpy()
    real = mask.astype(bool)  # padded positions' logits are unspecified in both
    np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4, atol=1e-4 * np.abs(ref[real]).max())


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", hf_fixtures.FAMILIES)
def test_reward_scores_match_transformers(checkpoints, family, side):
    path = checkpoints[family]["reward"]
    model, params = jodpo.load_model(str(path), task="reward")
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(1), LENGTHS, model.pad_token_id, side)
    ours = np.asarray(jax.jit(jodpo.reward_scores, static_argnums=0)(model, params, ids, mask))
    with torch.no_grad():
        ref = _hf(AutoModelForSequenceClassification, path)(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits[:, 0].numpy()
    assert ours.shape == (len(LENGTHS),)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_reward_reads_last_non_pad_token_like_transformers():
    # pad == EOS (Pythia's tokenizer): transformers reads the last token that is not pad, so a trailing
    # EOS is skipped; with no pad id jodpo falls back to the attention mask.
    model = decoder.Model(family="llama", task="reward", vocab_size=8, hidden_size=4, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=4, mlp=decoder.MLP(4, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                       qkv_bias=False, out_bias=False, parallel_residual=False,
                       rope=decoder.Rope(4, (1.0, 0.01)), tie_embeddings=False, pad_token_id=0)
    ids = jnp.array([[0, 0, 5, 6], [5, 6, 0, 0], [5, 6, 7, 0]])
    mask = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    assert heads.last_token_index(model, ids, mask).tolist() == [3, 1, 2]
    assert heads.last_token_index(model.replace(pad_token_id=None), ids, mask).tolist() == [3, 3, 3]


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked_cache", "per_layer_cache"])
@pytest.mark.parametrize("family", hf_fixtures.DECODER_FAMILIES)
def test_kv_cache_decoding_equals_full_forward(checkpoints, family, per_layer):
    model, stacked = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    # per_layer is the sampler's layout: split weights, one cache buffer per layer, layers unrolled.
    params = mparams.split_layers(model, stacked) if per_layer else stacked
    rng = np.random.default_rng(2)
    prompt, pmask = hf_fixtures.padded_batch(rng, [7, 3, 5], model.pad_token_id, "left")
    steps = 6
    new = rng.integers(3, 290, (3, steps)).astype(np.int32)
    full_ids = np.concatenate([prompt, new], 1)
    full_mask = np.concatenate([pmask, np.ones_like(new)], 1)
    full = np.asarray(jodpo.logits(model, stacked, full_ids, full_mask))

    step = jax.jit(decoder.hidden_states, static_argnums=0, static_argnames="empty_cache")
    cache = decoder.init_cache(model, 3, prompt.shape[1] + steps, per_layer=per_layer)
    # The prefill attends among the prompt's tokens (the forward's kernel) or over the whole empty slab: same.
    h_slab, _ = step(model, params, prompt, pmask, cache)
    h, cache = step(model, params, prompt, pmask, cache, empty_cache=True)
    real = pmask.astype(bool)
    np.testing.assert_allclose(np.asarray(h)[real], np.asarray(h_slab)[real], rtol=1e-5, atol=1e-5)
    got = [heads.lm_head(model, params, h)[:, -1]]
    for t in range(steps - 1):
        h, cache = step(model, params, new[:, t:t + 1], np.ones((3, 1), np.int32), cache)
        got.append(heads.lm_head(model, params, h)[:, -1])
    got = np.stack(got, 1)
    want = full[:, prompt.shape[1] - 1: prompt.shape[1] - 1 + steps]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert int(cache["index"]) == full_ids.shape[1] - 1


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma4"])
def test_chunks_of_tokens_after_a_filled_window_equal_the_full_forward(checkpoints, family):
    """Several new tokens after a cache already past the window (a prefill in chunks of 7, 3 and 4 tokens, windows of
    5-6): each attends to the ring's slots still within its window and to its chunk's earlier tokens, and Gemma 4's
    KV-sharing layer to the same, as the full forward's tokens do (stacked and per-layer caches)."""
    model, stacked = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(4), [14, 9, 12], model.pad_token_id, "left")
    assert ids.shape[1] == 14 and 4 < model.sliding_window < 7
    want = np.asarray(jodpo.logits(model, stacked, ids, mask))
    step = jax.jit(decoder.hidden_states, static_argnums=0, static_argnames="empty_cache")
    real = mask.astype(bool)
    for per_layer in (False, True):
        params = mparams.split_layers(model, stacked) if per_layer else stacked
        cache, got = decoder.init_cache(model, 3, 14, per_layer=per_layer), []
        for a, b in ((0, 7), (7, 10), (10, 14)):
            h, cache = step(model, params, ids[:, a:b], mask[:, a:b], cache, empty_cache=a == 0)
            got.append(np.asarray(heads.lm_head(model, params, h)))
        got = np.concatenate(got, 1)
        np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4 * np.abs(want[real]).max())


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-6), ("bfloat16", 1e-2)])
def test_forward_attention_equals_jodpos_own(dtype, tol):
    """The forwards' attention (token-major keys) and jax.nn.dot_product_attention called as the cuDNN path calls
    it (its XLA twin here), with jodpo's masks (left padding, causality, a window, grouped kv heads, rows that see
    no key), equal the einsum attention the decode steps use: values and gradients."""
    model = decoder.Model(family="llama", task="causal_lm", vocab_size=8, hidden_size=16, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp=decoder.MLP(8, "silu"), norms=decoder.Norms("rmsnorm", 1e-6),
                       qkv_bias=False, out_bias=False, parallel_residual=False,
                       rope=decoder.Rope(8, (1.0,) * 4), tie_embeddings=False, dtype=dtype)
    rng = np.random.default_rng(4)
    B, L, S = 3, 5, 7
    q = jnp.asarray(rng.normal(size=(B, L, 4, 8)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, S, 2, 8)), dtype) for _ in range(2))
    key_mask = np.ones((B, S), bool)
    key_mask[0, :3] = False  # left padding: the first query rows see nothing
    key_mask[2, 5:] = False
    dist = (np.arange(L)[:, None] + S - L) - np.arange(S)[None]
    attend = jnp.asarray(key_mask[:, None, :] & (dist >= 0) & (dist < 4))  # causal, window 4
    assert not attend[0, 0].any()

    def own(q, k, v):
        return layers.attention(model, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), attend)

    def fused(q, k, v):
        return layers.forward_attention(model, q, k, v, attend)

    def library(q, k, v):
        return layers.library_attention(model, q, k, v, attend, "xla")

    want = own(q, k, v)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    w = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)  # noqa
    for f in (fused, library):
        got = f(q, k, v)
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol)
        for a, b in zip(grad(own), grad(f)):
            np.testing.assert_allclose(f32(b), f32(a), rtol=tol, atol=tol * float(np.abs(f32(a)).max()))
    with pytest.raises(ValueError, match="attention must be one of"):
        model.replace(attention="flash")


@pytest.mark.parametrize("family", hf_fixtures.DECODER_FAMILIES)
def test_prefixed_forward_equals_full_forward_with_gradients(checkpoints, family):
    """Each prompt computed once for its n continuations equals the forward of the repeated rows: the hidden
    states at every real position, the gradient of a random functional of them, and the reward scores."""
    model, params = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    rng = np.random.default_rng(3)
    prompt, pmask = hf_fixtures.padded_batch(rng, [7, 3, 5], model.pad_token_id, "left")
    suffix, smask = hf_fixtures.padded_batch(rng, [4, 1, 6, 6, 2, 3], model.pad_token_id, "right")  # n = 2
    ids, mask = np.concatenate([np.tile(prompt, (2, 1)), suffix], 1), np.concatenate([np.tile(pmask, (2, 1)), smask], 1)
    weights = rng.normal(size=(*ids.shape, model.hidden_size)).astype(np.float32) * mask[..., None]

    def shared(p):
        return decoder.prefixed_hidden_states(model, p, prompt, pmask, suffix, smask)

    def repeated(p):
        return decoder.hidden_states(model, p, ids, mask)[0]

    got, want = jax.jit(shared)(params), jax.jit(repeated)(params)
    real = mask.astype(bool)
    # 1e-5 of the largest: float32's rounding in another order (Gemma 4's unscaled scores carry it furthest: 1.4-1.9e-5
    # of states up to 3.2 measured; in float64 throughout the two agree to 1e-14)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                               atol=1e-5 * float(np.abs(np.asarray(want)[real]).max()))
    g_got, g_want = (jax.jit(jax.grad(lambda p, f=f: jnp.sum(f(p) * weights)))(params) for f in (shared, repeated))
    # Gemma 4's gradients 5e-5 of the largest (3.6e-5 measured, the embeddings'; the forwards agree to 1e-14 in float64)
    tol = 5e-5 if family == "gemma4" else 2e-5
    for (path, a), b in zip(jax.tree.leaves_with_path(g_got), jax.tree.leaves(g_want)):
        scale = float(np.abs(b).max()) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol * scale, err_msg=jax.tree_util.keystr(path))
    rm, rm_params = jodpo.load_model(str(checkpoints[family]["reward"]), task="reward")
    # float32's rounding in another order: Gemma 4's unscaled scores (scale 1) carry it furthest (1.1e-5 measured; the
    # same forwards in float64 agree to 1e-6, the float32 score head's own rounding)
    np.testing.assert_allclose(np.asarray(heads.prefixed_reward_scores(rm, rm_params, prompt, pmask, suffix, smask)),
                               np.asarray(jodpo.reward_scores(rm, rm_params, ids, mask)), rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="block layout"):
        decoder.prefixed_hidden_states(model, params, prompt, pmask, suffix[:4], smask[:4])


def test_second_call_with_same_shapes_does_not_recompile(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))

    @jax.jit
    @chex.assert_max_traces(n=1)  # a second trace raises
    def f(params, ids, mask):
        return jodpo.logits(model, params, ids, mask)

    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(3), [4, 6], model.pad_token_id, "left")
    f(params, ids, mask).block_until_ready()
    ids2, mask2 = hf_fixtures.padded_batch(np.random.default_rng(4), [6, 2], model.pad_token_id, "left")
    f(params, ids2, mask2).block_until_ready()


def test_model_is_hashable_and_static(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    model2, _ = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    assert hash(model) == hash(model2) and model == model2
    axes = jodpo.param_axes(model)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)
    for ax, p in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(params)):
        assert len(ax) == p.ndim


def test_a_differentiated_layer_keeps_no_float32_copy_of_its_activations(checkpoints):
    """A LayerNorm's and an exact GELU's autodiff residuals outweigh their inputs (three float32 copies of the
    normalised input; four of the MLP's widest activation), so the backward recomputes them from their inputs: with
    bf16 compute a layer keeps no float32 array of the hidden width and one of the MLP width (torch keeps two)."""
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    model = model.replace(dtype="bfloat16")
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [7, 5], model.pad_token_id, "left")
    D, F = params["layers"]["mlp"]["up"].shape[1:]

    def loss(p):
        h, _ = decoder.hidden_states(model, p, jnp.asarray(ids), jnp.asarray(mask))
        return h.astype(jnp.float32).sum()

    _, backward = jax.vjp(loss, params)  # a pytree of what the backward keeps
    kept = [x for x in jax.tree.leaves(backward) if x.ndim >= 3 and x.shape[-3:-1] == ids.shape]  # activations
    assert not [x.shape for x in kept if x.dtype == jnp.float32 and x.shape[-1] == D]
    assert [x.shape for x in kept if x.shape[-1] == F] == [(model.num_layers, *ids.shape, F)]


def _gemma3_multimodal(cls, checkpoints, out):
    """A tiny random ``cls`` (a Gemma3ForConditionalGeneration-style model: the tiny Gemma 3 text model beside a
    one-layer SigLIP vision tower), saved to ``out``."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text = AutoModelForCausalLM.from_pretrained(checkpoints["gemma3"]["causal_lm"]).config
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=text.vocab_size - 1, boi_token_index=text.vocab_size - 3,
                       eoi_token_index=text.vocab_size - 2, num_labels=1)
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(out)
    return hf


def test_gemma3_multimodal_checkpoint_loads_its_language_model(checkpoints, tmp_path):
    """A Gemma3ForConditionalGeneration (4B-27B's class; here a tiny one with a one-layer vision tower) loads as its
    text model, saying in one line that the vision tower is left out: its logits on text equal the multimodal
    model's, and its export is a Gemma3ForCausalLM that transformers reads back to the same logits."""
    from transformers import Gemma3ForConditionalGeneration

    hf = _gemma3_multimodal(Gemma3ForConditionalGeneration, checkpoints, tmp_path / "mm")
    with pytest.warns(UserWarning, match=r"its language model loads as a text gemma3 model; its vision tower "
                                         r"\(\d+ tensors\) is left out"):
        model, params = jodpo.load_model(str(tmp_path / "mm"))
    assert model.family == "gemma3" and model.rope.local_inv_freq and model.tie_embeddings
    references.check_language_model_of_multimodal(hf, model, params, tmp_path / "text", "Gemma3ForCausalLM", 1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma3_multimodal_reward_head_scores_as_transformers(checkpoints, tmp_path, side):
    """A Gemma3ForSequenceClassification of the multimodal model (Gemma3ForConditionalGeneration's language model and
    vision tower, a score head) loads as a text reward model, its vision tower left out in one line, and scores text
    as transformers does: the value at the last token that is not the text config's pad id."""
    from transformers import Gemma3ForSequenceClassification

    hf = _gemma3_multimodal(Gemma3ForSequenceClassification, checkpoints, tmp_path / "rm")
    with pytest.warns(UserWarning, match=r"its vision tower \(\d+ tensors\) is left out"):
        model, params = jodpo.load_model(str(tmp_path / "rm"), task="reward")
    assert (model.family, model.task) == ("gemma3", "reward") and model.rope.local_inv_freq
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(9), LENGTHS, model.pad_token_id, side, high=200)
    ours = np.asarray(jax.jit(jodpo.reward_scores, static_argnums=0)(model, params, ids, mask))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits[:, 0].numpy()
    assert ours.shape == (len(LENGTHS),)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_cudnn_attention_cannot_soft_cap_so_a_gemma2_runs_its_own(checkpoints):
    """cuDNN's flash attention has no soft-capping: a Gemma 2 asked for it computes jodpo's own attention (on a CPU,
    where cuDNN would fail, the logits equal the XLA path's exactly) and ``attention_note`` says so in one line."""
    from jodpo.models.model import attention_note

    model, params = jodpo.load_model(str(checkpoints["gemma2"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(7), [6, 3], model.pad_token_id, "left")
    cudnn = model.replace(attention="cudnn")
    np.testing.assert_array_equal(np.asarray(jodpo.logits(cudnn, params, ids, mask)),
                                  np.asarray(jodpo.logits(model, params, ids, mask)))
    assert attention_note(cudnn) == ("attn_implementation='cudnn' cannot soft-cap attention scores (this gemma2 model "
                                     "caps them at 1): its attention runs on jodpo's own XLA path instead")
    assert attention_note(model) is None
    assert attention_note(jodpo.load_model(str(checkpoints["gemma3"]["causal_lm"]))[0].replace(attention="cudnn")) is None


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma2", "gemma3"])
def test_bfloat16_forward_matches_transformers_in_bfloat16(checkpoints, family):
    """bf16 weights and compute against transformers' bf16 model: Gemma's (1 + w) norms in float32, its embedding
    scale rounded to bf16 (sqrt(64) = 8 is exact; the scale is checked at a width where it is not, below). The
    tolerance is bf16's: a few units of its 2^-8 relative precision on the largest logit, over two layers."""
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path), dtype=jnp.bfloat16)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(8), LENGTHS, model.pad_token_id, "left")
    ours = np.asarray(jodpo.logits(model, params, ids, mask))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.float().numpy()
    real = mask.astype(bool)
    scale = np.abs(ref[real]).max()
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=8 * 2.0 ** -8 * scale)
    # the embedding scale as transformers rounds it: its float32 value, then bf16 (sqrt(3072) = 55.43 -> 55.5)
    x = layers.embed(model.replace(embed_scale=3072 ** 0.5), {"embed": jnp.ones((1, 2), jnp.bfloat16)}, jnp.zeros(1, int))
    assert float(x[0, 0]) == 55.5

"""The Gated DeltaNet mixer kind (jodpo.models.deltanet) through a whole Qwen3.5 model: padding is inert in its state
and its convolution window, and past one chunk of the delta rule (64 tokens) its logits equal transformers'."""
import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo.models import decoder
from tests import hf_fixtures


def _step(model, params, cache, token: int, real: bool):
    ids = jnp.full((1, 1), token, jnp.int32)
    h, cache = decoder.hidden_states(model, params, ids, jnp.full((1, 1), int(real), jnp.int32), cache)
    return h[:, -1], cache


def test_padding_leaves_the_state_and_the_window_as_they_were(checkpoints):
    """Issue 60: [x1 .. x5, pad, x6] ends in the state of [x1 .. x6]: a step on padding neither decays nor writes the
    recurrent state (g = beta = 0 there: transformers' sigmoid(0) and softplus(dt_bias) decayed it) and leaves the
    convolution's window as it was (it took in the pad's zeros). Through every layer of the model, step by step as
    the sampler decodes; the attention layers' caches skip the pad by their mask."""
    model, params = jodpo.load_model(str(checkpoints["qwen3_5"]["causal_lm"]))
    tokens = np.random.default_rng(0).integers(3, 200, 6)
    runs = {}
    for name, seq in {"with_pad": [*tokens[:5], None, tokens[5]], "without": list(tokens)}.items():
        cache = decoder.init_cache(model, 1, 8)
        h, cache = decoder.hidden_states(model, params, jnp.asarray(tokens[None, :5], jnp.int32),
                                         jnp.ones((1, 5), jnp.int32), cache, empty_cache=True)
        for t in seq[5:]:
            h, cache = _step(model, params, cache, 0 if t is None else int(t), t is not None)
        runs[name] = h, cache["state"]["deltanet"]
    (h_pad, s_pad), (h, s) = runs["with_pad"], runs["without"]
    for key in ("rec", "conv"):
        np.testing.assert_allclose(np.asarray(s_pad[key]), np.asarray(s[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(np.asarray(h_pad), np.asarray(h), rtol=1e-5, atol=1e-5)


def test_logits_past_one_chunk_match_transformers(checkpoints):
    """Rows of 80 and 70 tokens, left-padded: the chunked delta rule runs a second chunk of 64 (the fixtures'
    other tests stop at 13 tokens)."""
    path = checkpoints["qwen3_5"]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(3), [80, 70], model.pad_token_id, "left", high=200)
    ours = np.asarray(jax.jit(jodpo.logits, static_argnums=0)(model, params, ids, mask))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0), dtype=torch.long)).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4, atol=1e-4 * np.abs(ref[real]).max())

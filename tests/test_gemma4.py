"""Gemma 4 beyond the family-parametrized tests (whose fixture has every feature at once: tests/hf_fixtures.py): other
settings of its config against transformers (the 31B's layout: keys as values on global layers, no per-layer
embeddings, no KV sharing; KV sharing with values of their own and narrow MLPs, two readers of one layer, the last of
two sliding layers read), which layer each KV-sharing layer of E2B and E4B reads, the language model of a
Gemma4ForConditionalGeneration, the MoE settings it refuses, and the KV-sharing layers' cache: none of their own."""
import json

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo.models import decoder, families
from jodpo.models.loading import describe_model
from tests import helpers, hf_fixtures, references

S, F = "sliding_attention", "full_attention"
VARIANTS = {  # beside the fixture's: the 31B's layout, and KV sharing with v projections and narrow MLPs, where layers
    # 3 and 4 read the last of the two sliding layers before them (2, not 0) and layer 5 the global layer 1
    "31b": dict(layer_types=[S, F, S, S, F], attention_k_eq_v=True, num_global_key_value_heads=1,
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_bias=True,
                final_logit_softcapping=None),
    "shared_kv": dict(layer_types=[S, F, S, S, S, F], attention_k_eq_v=False, num_kv_shared_layers=3,
                      use_double_wide_mlp=False, hidden_size_per_layer_input=4),
}


def _tiny(tmp_path, checkpoints, **changes):
    from transformers import Gemma4TextConfig

    tok = jodpo.load_tokenizer(str(checkpoints["gemma4"]["causal_lm"]))
    base = json.loads((checkpoints["gemma4"]["causal_lm"] / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "sliding_window", "pad_token_id", "eos_token_id", "bos_token_id", "max_position_embeddings")
    cfg = Gemma4TextConfig(**{k: base[k] for k in keep}, global_head_dim=32,
                           num_hidden_layers=len(changes["layer_types"]), vocab_size_per_layer_input=base["vocab_size"],
                           **changes)
    torch.manual_seed(3)
    hf = hf_fixtures.randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)).eval()
    hf.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return hf, tmp_path / "m"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_settings_match_transformers_logits_and_generate(checkpoints, tmp_path, variant):
    hf, path = _tiny(tmp_path, checkpoints, **VARIANTS[variant])
    model, params = jodpo.load_model(str(path))
    assert ("shared_sliding_attention" in model.kinds) == (variant == "shared_kv")
    helpers.assert_equals_transformers(model, params, hf)


@pytest.mark.parametrize("name", ["gemma-4-e2b", "gemma-4-e4b"])
def test_kv_sharing_layers_read_the_layer_transformers_stores(name):
    """E2B's and E4B's configs (benchmarks/configs): jodpo's readers (the last num_kv_shared_layers) read the last
    layer of their type before them, which is the layer transformers' kv_sharing_modes has store its keys and values."""
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(**json.loads((helpers.ROOT / "benchmarks" / "configs" / f"{name}.json").read_text()))
    model = families.model_from_hf_config(cfg, "causal_lm", dtype="float32", eos_token_ids=[1])
    modes = cfg.kv_sharing_modes
    stores = {cfg.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    readers = [i for i, k in enumerate(model.kinds) if k in decoder.READS]
    assert readers == [i for i, m in enumerate(modes) if m == "reuse"] and len(readers) == cfg.num_kv_shared_layers
    assert {stores[cfg.layer_types[i]] for i in readers} == set(stores.values())  # both types read, 4 sliding to 1
    for i in readers:
        assert model.layers_of(decoder.READS[model.kinds[i]])[-1] == stores[cfg.layer_types[i]], i
    # a reader computes with its source kind's attention description: the global layers' own shape, the sliding window
    raw = json.loads((helpers.ROOT / "benchmarks" / "configs" / f"{name}.json").read_text())
    g, w = model.attention_of("shared_global_attention"), model.attention_of("shared_sliding_attention")
    assert g is model.global_attention and w == model.attention_of("sliding_attention")
    assert (g.head_dim, g.window, w.head_dim, w.window) == (raw["global_head_dim"], 0, raw["head_dim"],
                                                            raw["sliding_window"])


def test_kv_sharing_layers_keep_no_cache_of_their_own(checkpoints):
    """The fixture's last two layers reuse the keys and values of layers 0 and 1: the cache holds states for those two
    only, and a decode step writes them (the readers read them where they are)."""
    model, params = jodpo.load_model(str(checkpoints["gemma4"]["causal_lm"]))
    assert model.kinds[2:] == ("shared_sliding_attention", "shared_global_attention")
    stacked = decoder.init_cache(model, 2, 16)
    assert set(stacked["state"]) == {"sliding_attention", "global_attention"}
    assert stacked["state"]["sliding_attention"]["k"].shape[0] == 1
    assert stacked["state"]["global_attention"]["k"].shape[0] == 1
    per_layer = decoder.init_cache(model, 2, 16, per_layer=True)
    assert [s is None for s in per_layer["state"]] == [False, False, True, True]
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(1), [5, 3], model.pad_token_id, "left")
    _, cache = decoder.hidden_states(model, params, ids, mask, stacked)
    assert jax.tree.structure(cache["state"]) == jax.tree.structure(stacked["state"])
    assert float(np.abs(np.asarray(cache["state"]["global_attention"]["v"])).max()) > 0  # keys as values, written


def test_a_conditional_generation_checkpoint_loads_its_language_model(checkpoints, tmp_path):
    """A Gemma4ForConditionalGeneration (the released checkpoints' class; here with one-layer vision and audio towers)
    loads as its text model, one line saying the towers are left out: logits on text equal the multimodal model's, and
    its export is a Gemma4ForCausalLM that transformers reads back to the same logits."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    text = AutoModelForCausalLM.from_pretrained(checkpoints["gemma4"]["causal_lm"]).config
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              subsampling_conv_channels=[4, 4], output_proj_dims=16)
    V = text.vocab_size
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict(),
                       image_token_id=V - 1, video_token_id=V - 2, audio_token_id=V - 3, boi_token_id=V - 4,
                       eoi_token_id=V - 5, boa_token_id=V - 6, eoa_token_index=V - 7)
    torch.manual_seed(0)
    hf = hf_fixtures.randomize(Gemma4ForConditionalGeneration(cfg)).eval()
    hf.save_pretrained(tmp_path / "mm")
    with pytest.warns(UserWarning, match=r"its language model loads as a text gemma4 model; its .* are left out") as w:
        model, params = jodpo.load_model(str(tmp_path / "mm"))
    said = next(str(x.message) for x in w if "left out" in str(x.message))
    assert "its vision tower (" in said and "its audio tower (" in said
    references.check_language_model_of_multimodal(hf, model, params, tmp_path / "text", "Gemma4ForCausalLM", 1e-4)


@pytest.mark.parametrize("change,field", [(dict(top_k_experts=9), "top_k_experts"),
                                          (dict(moe_intermediate_size=None), "moe_intermediate_size")])
def test_moe_settings_jodpo_cannot_honour_are_refused_naming_the_field(checkpoints, tmp_path, change, field):
    """The MoE checkpoints (26B-A4B) load (tests/test_moe.py); experts it cannot have are refused in one line."""
    config = json.loads((checkpoints["gemma4"]["causal_lm"] / "config.json").read_text())
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8)
    (tmp_path / "config.json").write_text(json.dumps(config | moe | change))
    with pytest.raises(jodpo.CheckpointError, match=rf"^.*: .*{field}=[^\n]*$"):
        describe_model(str(tmp_path))

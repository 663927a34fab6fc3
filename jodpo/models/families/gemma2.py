"""Gemma 2: Llama's tensor layout with Gemma's arithmetic. RMSNorm as x * (1 + w) in float32, four norms a layer
(the attention's and the MLP's outputs are normed before their residuals), embeddings scaled by sqrt(hidden_size)
rounded to the compute dtype, GeGLU with tanh-approximated GELU, scores scaled by ``query_pre_attn_scalar ** -0.5``,
local (sliding-window) and global layers by ``layer_types``, and attention scores and final logits soft-capped
(``attn_logit_softcapping``, ``final_logit_softcapping``). Its fields are the base of Gemma 3's."""
from __future__ import annotations

from jodpo.errors import UnsupportedModelError
from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family
from jodpo.models.model import MLP, Norms


def model_fields(cfg) -> dict:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{cfg.model_type} with use_bidirectional_attention=True (an embedding model) is "
                                    "not a causal LM; jodpo trains causal Gemma models")
    return dict(num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                norms=Norms("rmsnorm", cfg.rms_norm_eps, offset=1.0, sites="sandwich"),
                mlp=MLP(cfg.intermediate_size, cfg.hidden_activation), qkv_bias=bool(cfg.attention_bias),
                out_bias=bool(cfg.attention_bias), parallel_residual=False, embed_scale=float(cfg.hidden_size ** 0.5),
                query_scale=float(cfg.query_pre_attn_scalar ** -0.5),
                attn_softcap=float(cfg.attn_logit_softcapping or 0.0),
                final_softcap=float(cfg.final_logit_softcapping or 0.0))


FAMILY = Family(
    name="gemma2", module="gemma2", classes={"gemma2": "Gemma2"}, model_fields=model_fields, rules=llama.rules,
    lora_modules=llama.LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=llama.LORA_PATHS,
)

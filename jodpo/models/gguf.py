"""Reading a GGUF file (llama.cpp's format) as ``(Model, params)``, without torch (its tokenizer:
``jodpo.models.gguf_tokenizer``).

A GGUF file carries the architecture in its metadata, the tokenizer (vocabulary, merges, special tokens, chat
template) and the tensors, many of them quantized. jodpo reads it with the ``gguf`` package (llama.cpp's own
reader, numpy only), dequantizes every tensor to float32, renames llama.cpp's tensors to transformers' names, undoes
what llama.cpp's converter (``convert_hf_to_gguf.py``) did to them (the Q/K row permutation of Llama attention; the
+1 folded into Gemma's ``x * (1 + w)`` norm weights), and streams the result through the same per-family rules as a
safetensors checkpoint (``loading.load_params``). The dequantized weights are exactly what transformers'
``from_pretrained(dir, gguf_file=...)`` computes.

Supported: the ``llama`` (Llama, SmolLM, Mistral, TinyLlama), ``qwen2``, ``qwen3``, ``qwen35`` (Qwen3.5/3.6 dense, its
DeltaNet layers' value heads put back in transformers' order), ``gemma2``, ``gemma3`` (text) and ``gemma4`` (text,
dense: its layer pattern, head shapes, KV sharing and per-layer embeddings from the file) architectures, and the
mixtures of experts ``qwen3moe`` (Qwen3-30B-A3B), ``olmoe`` (OLMoE-1B-7B) and ``qwen35moe`` (Qwen3.5/3.6-MoE: its
experts merged into 3-D tensors, one a projection, split back into transformers' per-expert tensors), RoPE
without scaling or with linear scaling, and every quantization type the ``gguf`` package
dequantizes (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types). What a Gemma file does not say (its
local/global layer pattern, the local layers' RoPE base, the query scale) is what llama.cpp assumes
(``src/llama-model.cpp``), which are Gemma's own values (``Gemma2Config`` / ``Gemma3TextConfig``).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

from jodpo.errors import CheckpointError
import numpy as np


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gemma4": "Gemma4ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM"}
_QWEN35 = ("qwen35", "qwen35moe")  # Qwen3.5's hybrid of DeltaNet and gated attention, dense or with experts
# the mixtures of experts: transformers' model_type, and whether llama.cpp renormalises the top-k routing weights
# (src/models/<arch>.cpp's build_moe_ffn(..., norm_w, ...): fixed per architecture, read from no key)
_MOE = {"qwen3moe": ("qwen3_moe", True), "olmoe": ("olmoe", False), "qwen35moe": ("qwen3_5_moe_text", True)}

# llama.cpp's tensor names -> transformers' ({i}: the layer), as gguf-py's tensor_mapping.py pairs them
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_PRE_NORM = {"blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}  # the MLP's input norm
_QKV_BIAS = {f"blk.{{i}}.attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORMS = {f"blk.{{i}}.attn_{x}_norm.weight": f"model.layers.{{i}}.self_attn.{x}_norm.weight" for x in "qk"}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the MLP's input norm, as in Llama, but transformers calls that
# pre_feedforward_layernorm, and its post_attention_layernorm is the norm of the attention's output
_GEMMA_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Qwen3.5's DeltaNet layers (llama.cpp's Qwen3NextModel names them after its SSM layers) and its MLP's input norm
_LINEAR_ATTENTION = {f"blk.{{i}}.{g}": f"model.layers.{{i}}.linear_attn.{h}" for g, h in (
    ("attn_qkv.weight", "in_proj_qkv.weight"), ("attn_gate.weight", "in_proj_z.weight"),
    ("ssm_beta.weight", "in_proj_b.weight"), ("ssm_alpha.weight", "in_proj_a.weight"),
    ("ssm_out.weight", "out_proj.weight"), ("ssm_norm.weight", "norm.weight"), ("ssm_a", "A_log"),
    ("ssm_dt.bias", "dt_bias"), ("ssm_conv1d.weight", "conv1d.weight"))}
# Gemma 4's per-layer embeddings and layer scalars (llama.cpp names them after Gemma 3n's)
_GEMMA4 = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
    "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
    "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
    "blk.{i}.layer_output_scale.weight": "model.layers.{i}.layer_scalar",
}
# a mixture of experts' router, and Qwen3.5-MoE's shared expert and its gate (the experts' merged 3-D tensors: _EXPERTS)
_ROUTER = {"blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight"}
_SHARED = {f"blk.{{i}}.ffn_{x}_shexp.weight": f"model.layers.{{i}}.mlp.shared_expert.{x}_proj.weight"
           for x in ("gate", "up", "down")}
_SHARED["blk.{i}.ffn_gate_inp_shexp.weight"] = "model.layers.{i}.mlp.shared_expert_gate.weight"
# llama.cpp's merged experts [E, F, D] ([E, D, F] for down; gate and up concatenated [E, 2F, D] by the converter's
# --fuse-gate-up-exps) -> transformers' per-expert tensors (model.layers.{i}.mlp.experts.{e}.<name>.weight)
_EXPERTS = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
            "ffn_gate_up_exps": ("gate_proj", "up_proj")}
TENSOR_NAMES = {
    "llama": {**_NAMES, **_PRE_NORM, **_QKV_BIAS},
    "qwen2": {**_NAMES, **_PRE_NORM, **_QKV_BIAS},
    "qwen3": {**_NAMES, **_PRE_NORM, **_QK_NORMS},
    "gemma2": {**_NAMES, **_GEMMA_NORMS},
    "gemma3": {**_NAMES, **_GEMMA_NORMS, **_QK_NORMS},
    "gemma4": {**_NAMES, **_GEMMA_NORMS, **_QK_NORMS, **_GEMMA4},
    "qwen35": {**_NAMES, "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
               **_QK_NORMS, **_LINEAR_ATTENTION},
    "qwen3moe": {**_NAMES, **_PRE_NORM, **_QK_NORMS, **_ROUTER},
    "olmoe": {**_NAMES, **_PRE_NORM, **_QK_NORMS, **_ROUTER},
}
TENSOR_NAMES["qwen35moe"] = {**TENSOR_NAMES["qwen35"], **_ROUTER, **_SHARED}
# convert_hf_to_gguf.py stores Gemma's norm weights w of x * (1 + w) as 1 + w (llama.cpp's norm is x * w)
_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0, "qwen35": 1.0, "qwen35moe": 1.0}  # Qwen3.5's zero-centred norms too, but
# its DeltaNet's
# Gemma's end-of-turn token: llama.cpp stops at it by name (llama-vocab.cpp), and Gemma's generation_config.json
# lists it as an EOS id, while the file's eos_token_id is <eos>
_END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}


def tensor_names(arch: str, num_layers: int) -> dict[str, str]:
    """llama.cpp's tensor name -> transformers' for every tensor a file of ``arch`` may hold."""
    return {g.format(i=i): h.format(i=i) for i in range(num_layers) for g, h in TENSOR_NAMES[arch].items()}


def open_file(file: Path) -> "GGUF":
    """The opened file, parsed once per process while it is unchanged: ``load_model`` and ``load_tokenizer`` of the
    same file share it (the ``gguf`` reader parses every metadata string, SmolLM2's 49152-token vocabulary and its
    merges, in about 8 s on a CPU core)."""
    st = file.stat()
    return _opened(str(file.absolute()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _opened(file: str, mtime_ns: int, size: int) -> "GGUF":
    return GGUF(Path(file))


def damaged(file: Path, error: Exception) -> str:
    """Why ``file`` did not read, for a person: a file that starts as GGUF but does not read to its end is truncated
    (a download stopped early) or damaged; anything else is not GGUF at all. The reader's own words (a reshape, a
    dtype view) say neither."""
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return (f"{file}: not a readable GGUF file (it does not start with GGUF's magic bytes, b'GGUF'); download it "
                "again")
    return (f"{file}: a truncated or damaged GGUF file ({file.stat().st_size:,} bytes; its metadata or tensors end "
            f"early: {type(error).__name__}: {error}); download it again (a download that stopped early leaves such "
            "a file)")


def find(path: Path) -> Path | None:
    """The GGUF file that ``path`` names: the file itself, or the single ``.gguf`` file of a directory that
    holds no ``config.json`` (a transformers directory is read as one). None when ``path`` is not GGUF."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{path}: holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); "
                              "pass the path of the one to load.")
    return files[0] if files else None


class GGUF:
    """One opened GGUF file: its metadata as Python values, and its tensors."""

    def __init__(self, file: Path):
        import gguf

        self.file = file
        try:
            self.reader = gguf.GGUFReader(file)
        except (ValueError, OSError, IndexError, KeyError) as e:
            raise CheckpointError(damaged(file, e)) from e
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{file}: GGUF architecture {self.arch!r} is not supported; jodpo reads "
                                  f"{sorted(ARCHITECTURES)} GGUF files (other families: a transformers directory).")
        self.tensor_names = {t.name for t in self.reader.tensors}

    def value(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default=None):
        return self.value(f"{self.arch}.{key}", default)

    # ----------------------------------------------------------------------------------------------
    # The model's config
    # ----------------------------------------------------------------------------------------------

    def hf_config(self):
        """The transformers config this file describes (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``,
        ``Gemma2Config`` or ``Gemma3TextConfig``)."""
        from transformers import AutoConfig

        if "rope_freqs.weight" in self.tensor_names and self.arch != "gemma4":
            raise CheckpointError(f"{self.file}: uses per-frequency RoPE factors (rope_freqs: Llama 3.1-style "
                                  "scaling), which jodpo does not read from GGUF; load the transformers directory.")
        heads = int(self.arch_value("attention.head_count"))
        hidden = int(self.arch_value("embedding_length"))
        layers = self.num_layers()
        head_dim = int(self.arch_value("attention.key_length", hidden // heads))
        kv_heads, ff = self.arch_value("attention.head_count_kv", heads), self.arch_value("feed_forward_length")
        vocab = self.arch_value("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        ids = {k: self.value(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        cfg = dict(
            architectures=[ARCHITECTURES[self.arch]], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(min(ff) if isinstance(ff, list) else ff or 0), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads),
            head_dim=head_dim, max_position_embeddings=int(self.arch_value("context_length")),
            rms_norm_eps=float(self.arch_value("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.tensor_names, bos_token_id=ids["bos"],
            eos_token_id=ids["eos"], pad_token_id=ids["padding"],
        )
        if self.arch in _MOE:  # (Qwen3.5-MoE has no dense width: its converter writes feed_forward_length only if any)
            cfg |= self._moe(cfg.pop("intermediate_size") if self.arch == "qwen35moe" else cfg["intermediate_size"])
        if self.arch in _QWEN35:
            model_type = "qwen3_5_text" if self.arch == "qwen35" else _MOE[self.arch][0]
            return AutoConfig.for_model(model_type, **cfg, **self._qwen35(layers, head_dim))
        if self.arch in _MOE:
            return AutoConfig.for_model(_MOE[self.arch][0], **cfg, hidden_act="silu", rope_parameters=self._rope())
        if self.arch == "gemma4":
            return AutoConfig.for_model("gemma4_text", **(cfg | self._gemma4(layers, kv_heads, ff)))
        if not self.arch.startswith("gemma"):
            return AutoConfig.for_model(self.arch, **cfg, hidden_act="silu", rope_parameters=self._rope())
        # Gemma 2 and 3 as llama.cpp runs them (src/llama-model.cpp, which reads none of this from the file): every
        # 2nd (Gemma 2) or 6th (Gemma 3) layer global, the others local with the file's sliding window; queries
        # scaled by 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden / heads) (Gemma2Config's and
        # Gemma3TextConfig's query_pre_attn_scalar: 144 and 168 there, 256 = head_dim elsewhere)
        every, layers_27b = {"gemma2": (2, 46), "gemma3": (6, 62)}[self.arch]
        if self.arch_value("attention.sliding_window") is None:
            raise CheckpointError(f"{self.file}: a GGUF {self.arch} file without {self.arch}.attention.sliding_window;"
                                  " re-convert it with llama.cpp's convert_hf_to_gguf.py.")
        cfg |= dict(
            hidden_activation="gelu_pytorch_tanh", sliding_window=int(self.arch_value("attention.sliding_window")),
            layer_types=["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)],
            query_pre_attn_scalar=hidden // heads if layers == layers_27b else head_dim,
        )
        # soft-capping: Gemma 2's files carry both values (absent: llama.cpp's and Gemma2Config's 50 and 30)
        cfg |= {k: float(v) for k in ("attn_logit_softcapping", "final_logit_softcapping")
                if (v := self.arch_value(k)) is not None}
        if self.arch == "gemma2":
            return AutoConfig.for_model("gemma2", **cfg, rope_parameters=self._rope())
        # Gemma 3: the file's RoPE base and scaling are the global layers'; the local layers' base is 10,000 unless
        # the file says otherwise (llama.cpp's rope_freq_base_train_swa; Gemma3TextConfig's rope_local_base_freq)
        local = {"rope_type": "default", "rope_theta": float(self.arch_value("rope.freq_base_swa", 10000.0))}
        return AutoConfig.for_model("gemma3_text", **cfg,
                                    rope_parameters={"full_attention": self._rope(1e6), "sliding_attention": local})

    def num_layers(self) -> int:
        """The decoder's layers: ``block_count``, less the multi-token-prediction blocks a Qwen3.5 file appends to its
        stack (``nextn_predict_layers``: llama.cpp's converter writes Qwen3.5's ``mtp.*`` layers as the last blocks)."""
        return int(self.arch_value("block_count")) - int(self.arch_value("nextn_predict_layers", 0))

    def _moe(self, ff: int) -> dict:
        """A mixture of experts' fields as llama.cpp's converter writes them (TextModel and Qwen2MoeModel's
        set_gguf_parameters) and as llama.cpp runs them (src/models/<arch>.cpp): ``expert_count``,
        ``expert_used_count``, the experts' width (``expert_feed_forward_length``; OLMoE's is ``feed_forward_length``,
        and where a Qwen file has no key llama.cpp takes ``feed_forward_length / expert_used_count``), the shared
        expert's (``expert_shared_feed_forward_length``, else ``feed_forward_length``), the routing weights renormalised
        by the architecture (Qwen: yes, OLMoE: no; no key says it)."""
        experts, used = (self.arch_value(k) for k in ("expert_count", "expert_used_count"))
        if not experts or not used:
            raise CheckpointError(f"{self.file}: a GGUF {self.arch} file without {self.arch}.expert_count and "
                                  f"{self.arch}.expert_used_count; re-convert it with llama.cpp's "
                                  "convert_hf_to_gguf.py.")
        scale = self.arch_value("expert_weights_scale")
        if scale not in (None, 0.0, 1.0):
            raise CheckpointError(f"{self.file}: {self.arch}.expert_weights_scale = {scale} scales the routing "
                                  f"weights, which {self.arch} models do not (transformers has no such factor); "
                                  "re-convert it without one.")
        def width(key, default):
            value = int(self.arch_value(key, default))
            if value <= 0:
                raise CheckpointError(f"{self.file}: a GGUF {self.arch} file without {self.arch}.{key}; re-convert it "
                                      "with llama.cpp's convert_hf_to_gguf.py.")
            return value

        out = dict(num_experts=int(experts), num_experts_per_tok=int(used))
        if self.arch == "olmoe":
            return out | dict(intermediate_size=width("feed_forward_length", ff), norm_topk_prob=False)
        out["moe_intermediate_size"] = width("expert_feed_forward_length", ff // int(used))
        if self.arch == "qwen35moe":  # always renormalised: transformers' config has no norm_topk_prob
            return out | dict(shared_expert_intermediate_size=width("expert_shared_feed_forward_length", ff))
        return out | dict(norm_topk_prob=_MOE[self.arch][1])

    def _qwen35(self, layers: int, head_dim: int) -> dict:
        """Qwen3.5's own fields as llama.cpp's converter writes them (Qwen3NextModel.set_gguf_parameters): the DeltaNet
        layers' shape under ssm.*, every full_attention_interval-th layer softmax attention, the rotary width."""
        v_heads = int(self.arch_value("ssm.time_step_rank"))
        interval = int(self.arch_value("full_attention_interval", 4))
        rotary = int(self.arch_value("rope.dimension_count", head_dim // 4))
        return dict(hidden_act="silu", linear_conv_kernel_dim=int(self.arch_value("ssm.conv_kernel")),
                    linear_key_head_dim=int(self.arch_value("ssm.state_size")),
                    linear_num_key_heads=int(self.arch_value("ssm.group_count")), linear_num_value_heads=v_heads,
                    linear_value_head_dim=int(self.arch_value("ssm.inner_size")) // v_heads,
                    layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(layers)],
                    rope_parameters={**self._rope(), "partial_rotary_factor": rotary / head_dim})

    def _gemma4(self, layers: int, kv_heads, ff) -> dict:
        """Gemma 4's own fields as llama.cpp's converter writes them (Gemma4Model.set_gguf_parameters): each layer
        sliding or not (sliding_window_pattern), the global layers' head size (key_length) beside the sliding ones'
        (key_length_swa), the kv heads and MLP widths per layer (double-wide on the KV-sharing layers), the global
        layers' proportional RoPE as a rope_freqs tensor of 1 (rotated) and 1e30 (unrotated) frequency factors; values
        that are the keys where a global layer has no attn_v."""
        if self.arch_value("expert_count"):
            raise CheckpointError(f"{self.file}: Gemma 4's mixture-of-experts checkpoints (26B-A4B) are not supported; "
                                  "the dense ones are (E2B, E4B, 31B)")
        sliding = [bool(s) for s in self.arch_value("attention.sliding_window_pattern")]
        kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
        ff = ff if isinstance(ff, list) else [ff] * layers
        shared = int(self.arch_value("attention.shared_kv_layers", 0))
        full = [i for i in range(layers) if not sliding[i]]
        swa_dim = int(self.arch_value("attention.key_length_swa"))
        full_dim = int(self.arch_value("attention.key_length"))
        tensors = {t.name: t for t in self.reader.tensors}
        rotated = int(np.sum(np.asarray(tensors["rope_freqs.weight"].data, np.float32) == 1.0))
        table = tensors.get("per_layer_token_embd.weight")
        first_sliding = next(i for i in range(layers) if sliding[i])
        return dict(
            hidden_activation="gelu_pytorch_tanh", head_dim=swa_dim, global_head_dim=full_dim,
            num_key_value_heads=int(kv_heads[first_sliding]), num_global_key_value_heads=int(kv_heads[full[0]]),
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            sliding_window=int(self.arch_value("attention.sliding_window")), num_kv_shared_layers=shared,
            use_double_wide_mlp=len(set(ff)) > 1, attention_k_eq_v=f"blk.{full[0]}.attn_v.weight" not in tensors,
            hidden_size_per_layer_input=int(self.arch_value("embedding_length_per_layer_input", 0)),
            vocab_size_per_layer_input=int(table.shape[-1]) if table is not None else 262144,
            final_logit_softcapping=self.arch_value("final_logit_softcapping"),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": float(
                                 self.arch_value("rope.freq_base_swa", 10000.0))},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated /
                                                full_dim, "rope_theta": float(self.arch_value("rope.freq_base"))}})

    def _rope(self, default_base: float = 10000.0) -> dict:
        rope = {"rope_type": "default", "rope_theta": float(self.arch_value("rope.freq_base", default_base))}
        scaling = self.arch_value("rope.scaling.type", "none")
        if scaling == "linear":
            return {**rope, "rope_type": "linear", "factor": float(self.arch_value("rope.scaling.factor"))}
        if scaling not in ("none", None):
            raise CheckpointError(f"{self.file}: RoPE scaling {scaling!r} in GGUF is not supported (none, linear).")
        return rope

    def eos_token_ids(self) -> list[int]:
        """EOS and end-of-turn ids (llama.cpp stops at both, as transformers' generation config lists them)."""
        ids = [self.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if self.arch in _END_OF_TURN and tokens is not None:
            name = _END_OF_TURN[self.arch].encode()
            ids += [i for i, k in enumerate(tokens.data) if tokens.parts[k].tobytes() == name]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    # ----------------------------------------------------------------------------------------------
    # Tensors
    # ----------------------------------------------------------------------------------------------

    def tensors(self, heads: int, kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
        """(transformers name, float32 array in transformers' layout) for every tensor, one at a time."""
        layers = self.num_layers()
        names = tensor_names(self.arch, layers)
        shift = np.float32(_NORM_SHIFT.get(self.arch, 0.0))
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight" and self.arch == "gemma4":  # the proportional RoPE (hf_config's)
                continue
            block, _, rest = t.name.removeprefix("blk.").partition(".")
            if t.name.startswith("blk.") and block.isdecimal() and int(block) >= layers:
                continue  # a multi-token-prediction block (Qwen3.5's), as a checkpoint's mtp.* is left out
            if self.arch in _MOE and rest.split(".")[0] in _EXPERTS:
                yield from self._experts(t, int(block), rest.split(".")[0])
                continue
            if t.name not in names:
                raise CheckpointError(f"{self.file}: unexpected tensor {t.name!r} for a GGUF {self.arch} model.")
            w = self._dequantized(t)
            if rest == "ffn_gate_inp_shexp.weight":
                w = w.reshape(1, -1)  # [D] where a converter squeezed transformers' [1, D]
            if self.arch == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
                w = _unpermute(w, heads if t.name.split(".")[-2] == "attn_q" else kv_heads)
            if shift and t.name.endswith("norm.weight") and not t.name.endswith("ssm_norm.weight"):
                w = w - shift
            if self.arch in _QWEN35:
                w = self._qwen35_tensor(t.name, w)
            yield names[t.name], w

    def _dequantized(self, t) -> np.ndarray:
        """A tensor as float32 in transformers' axis order (GGUF lists a tensor's dimensions innermost first)."""
        from gguf import GGMLQuantizationType, quants

        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(t.tensor_type).name
            raise CheckpointError(f"{self.file}: tensor {t.name} is quantized as {kind}, which the gguf package "
                                  "cannot dequantize; use a file quantized differently (e.g. Q8_0, Q4_K_M) or "
                                  "the transformers checkpoint.") from None
        return np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))

    def _experts(self, t, layer: int, part: str) -> Iterator[tuple[str, np.ndarray]]:
        """One layer's merged experts ([E, F, D], down [E, D, F], gate and up fused [E, 2F, D]) as transformers 5.24
        saves them, one tensor an expert and projection."""
        w = self._dequantized(t)
        for e, we in enumerate(w):
            for name, x in zip(_EXPERTS[part], np.split(we, len(_EXPERTS[part]), 0)):
                yield f"model.layers.{layer}.mlp.experts.{e}.{name}.weight", x

    def _qwen35_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """A DeltaNet tensor back to transformers' form: llama.cpp's converter stores -exp(A_log), the convolution
        squeezed to [channels, width], and, where value heads outnumber key heads, the value heads reordered from
        transformers' grouped order (each key head's value heads together) to a tiled one
        (_LinearAttentionVReorderBase)."""
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part == "ssm_a":
            w = np.log(-w)
        elif part == "ssm_conv1d":
            w = w[:, None, :]
        k_heads, v_heads = int(self.arch_value("ssm.group_count")), int(self.arch_value("ssm.time_step_rank"))
        if k_heads == v_heads or not part.startswith(("attn_qkv", "attn_gate", "ssm_")) or part == "ssm_norm":
            return w
        v_dim = int(self.arch_value("ssm.inner_size")) // v_heads
        qk = 2 * k_heads * int(self.arch_value("ssm.state_size"))
        grouped = lambda x, axis, dim: _untile(x, axis, k_heads, v_heads // k_heads, dim)  # noqa: E731
        if part in ("attn_qkv", "ssm_conv1d"):  # only the value channels, after q and k
            return np.concatenate([w[:qk], grouped(w[qk:], 0, v_dim)], 0)
        if part == "attn_gate":
            return grouped(w, 0, v_dim)
        if part == "ssm_out":
            return grouped(w, 1, v_dim)
        return grouped(w, 0, 1)  # ssm_beta, ssm_alpha (rows), ssm_a, ssm_dt (one value a head)


def _untile(w: np.ndarray, axis: int, k_heads: int, per_k: int, dim: int) -> np.ndarray:
    """Value heads along ``axis`` from llama.cpp's tiled order (value head r of every key head, then r + 1) back to
    transformers' grouped one (a key head's ``per_k`` value heads together), ``dim`` entries a head."""
    shape = w.shape
    w = w.reshape(shape[:axis] + (per_k, k_heads, dim) + shape[axis + 1:])
    return np.swapaxes(w, axis, axis + 1).reshape(shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (convert_hf_to_gguf.py: each head's rotary halves interleaved
    for its rotate-by-pairs RoPE), back to transformers' rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

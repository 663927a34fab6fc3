"""Reading a GGUF file (llama.cpp's format) as ``(Model, params)`` and a tokenizer, without torch.

A GGUF file carries the architecture in its metadata, the tokenizer (vocabulary, merges, special tokens, chat
template) and the tensors, many of them quantized. jodpo reads it with the ``gguf`` package (llama.cpp's own
reader, numpy only), dequantizes every tensor to float32, renames llama.cpp's tensors to transformers' names,
undoes the Q/K row permutation that llama.cpp's converter applies to Llama attention, and streams the result
through the same per-family rules as a safetensors checkpoint (``loading.load_params``). The dequantized
weights are exactly what transformers' ``from_pretrained(dir, gguf_file=...)`` computes.

Supported: the ``llama`` (Llama, SmolLM, Mistral, TinyLlama) and ``qwen2`` architectures, RoPE without scaling
or with linear scaling, and every quantization type the ``gguf`` package dequantizes (F32, F16, BF16, Q4_0 ...
Q8_0, the K-quants, the IQ types).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

from jodpo.errors import CheckpointError
import numpy as np


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's tensor names -> transformers' ({i}: the layer)
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def open_file(file: Path) -> "GGUF":
    """The opened file, parsed once per process while it is unchanged: ``load_model`` and ``load_tokenizer`` of the
    same file share it (the ``gguf`` reader parses every metadata string, SmolLM2's 49152-token vocabulary and its
    merges, in about 8 s on a CPU core)."""
    st = file.stat()
    return _opened(str(file.absolute()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _opened(file: str, mtime_ns: int, size: int) -> "GGUF":
    return GGUF(Path(file))


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
        except (ValueError, OSError, IndexError) as e:
            raise CheckpointError(f"{file}: not a readable GGUF file ({e}). Re-download it.") from e
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
        """The transformers config this file describes (``LlamaConfig`` / ``Qwen2Config``)."""
        from transformers import AutoConfig

        if "rope_freqs.weight" in self.tensor_names:
            raise CheckpointError(f"{self.file}: uses per-frequency RoPE factors (rope_freqs: Llama 3.1-style "
                                  "scaling), which jodpo does not read from GGUF; load the transformers directory.")
        heads = int(self.arch_value("attention.head_count"))
        hidden = int(self.arch_value("embedding_length"))
        rope = {"rope_type": "default", "rope_theta": float(self.arch_value("rope.freq_base", 10000.0))}
        scaling = self.arch_value("rope.scaling.type", "none")
        if scaling == "linear":
            rope = {**rope, "rope_type": "linear", "factor": float(self.arch_value("rope.scaling.factor"))}
        elif scaling not in ("none", None):
            raise CheckpointError(f"{self.file}: RoPE scaling {scaling!r} in GGUF is not supported (none, linear).")
        vocab = self.arch_value("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        ids = {k: self.value(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        cfg = dict(
            architectures=[ARCHITECTURES[self.arch]], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(self.arch_value("feed_forward_length")),
            num_hidden_layers=int(self.arch_value("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(self.arch_value("attention.head_count_kv", heads)),
            head_dim=int(self.arch_value("attention.key_length", hidden // heads)),
            max_position_embeddings=int(self.arch_value("context_length")),
            rms_norm_eps=float(self.arch_value("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
            tie_word_embeddings="output.weight" not in self.tensor_names, bos_token_id=ids["bos"],
            eos_token_id=ids["eos"], pad_token_id=ids["padding"], hidden_act="silu",
        )
        return AutoConfig.for_model(self.arch, **cfg)

    def eos_token_ids(self) -> list[int]:
        """EOS and end-of-turn ids (llama.cpp stops at both, as transformers' generation config lists them)."""
        ids = [self.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        return [int(i) for i in ids if i is not None]

    # ----------------------------------------------------------------------------------------------
    # Tensors
    # ----------------------------------------------------------------------------------------------

    def tensors(self, heads: int, kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
        """(transformers name, float32 array in transformers' layout) for every tensor, one at a time."""
        from gguf import GGMLQuantizationType, quants

        names = {}
        for i in range(int(self.arch_value("block_count"))):
            names.update({g.format(i=i): h.format(i=i) for g, h in _NAMES.items()})
        for t in self.reader.tensors:
            if t.name not in names:
                raise CheckpointError(f"{self.file}: unexpected tensor {t.name!r} for a GGUF {self.arch} model.")
            try:
                w = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                kind = GGMLQuantizationType(t.tensor_type).name
                raise CheckpointError(f"{self.file}: tensor {t.name} is quantized as {kind}, which the gguf package "
                                      "cannot dequantize; use a file quantized differently (e.g. Q8_0, Q4_K_M) or "
                                      "the transformers checkpoint.") from None
            w = np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
            if self.arch == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
                w = _unpermute(w, heads if t.name.split(".")[-2] == "attn_q" else kv_heads)
            yield names[t.name], w


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (convert_hf_to_gguf.py: each head's rotary halves interleaved
    for its rotate-by-pairs RoPE), back to transformers' rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------

_SPECIAL = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def tokenizer(file: Path):
    """The file's tokenizer as a ``transformers.PreTrainedTokenizerFast`` with its chat template.

    transformers' own GGUF tokenizer path reads the file with a torch-based reader; this reads the metadata with
    the ``gguf`` package and hands it to transformers' converter (``convert_gguf_tokenizer``, no torch), so the
    result is the same tokenizer (tests/test_real_model.py compares them on SmolLM2)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    g = open_file(file)
    tok_dict, config = ({ours: g.value(f"tokenizer.{key}") for key, ours in GGUF_TOKENIZER_MAPPING[group].items()
                         if f"tokenizer.{key}" in g.reader.fields} for group in ("tokenizer", "tokenizer_config"))
    if "tokens" not in tok_dict:
        raise CheckpointError(f"{file}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens).")
    if tok_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # as transformers: llama.cpp adds BOS to such a vocabulary
    for name, key in _SPECIAL.items():
        token_id = g.value(f"tokenizer.ggml.{key}_token_id")
        config[name] = tok_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(g.arch, tok_dict)
    config = {k: v for k, v in {**config, **extra}.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)

"""A GGUF file's tokenizer (vocabulary, merges, special tokens, chat template) as a transformers tokenizer, without
torch: the metadata read with the ``gguf`` package (``jodpo.models.gguf``) and handed to transformers' converter."""
from __future__ import annotations

from pathlib import Path

from jodpo.errors import CheckpointError
from jodpo.models.gguf import open_file

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
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **config)
    tok.name_or_path = str(file)  # so that messages about it (no chat template, say) can name it
    return tok

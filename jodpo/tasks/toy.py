"""A tiny world for the embedded default (``configs/tiny.py``): built in code, nothing downloaded.

A word-level tokenizer over a small vocabulary of positive, negative and neutral words, a tiny random
Llama written as a real transformers checkpoint (so the normal loading path runs), a prompt dataset, and a
programmatic reward: the sentiment of the completion, (#positive - #negative) / max(4, #words), in [-1, 1]. A random
policy scores about 0; online DPO visibly pushes it towards +1 within a couple of minutes on a laptop CPU.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from jodpo.models.params import init_params
from jodpo.models.export import save_hf
from jodpo.models.families import model_from_hf_config

POSITIVE = "good great happy love wonderful bright kind calm joy brilliant lovely fine warm nice best".split()
NEGATIVE = "bad awful sad hate terrible dark cruel angry pain dull ugly poor cold nasty worst".split()
NEUTRAL = "the a is it was and of to in on with this that very so".split()
TOPICS = "movie book song city dog meal trip game show garden friend day school park coffee".split()
SPECIAL = ["<pad>", "<eos>", "review", ":"]
VERSION = 1  # bump when anything below changes, so old cached worlds are rebuilt


def vocabulary() -> list[str]:
    return SPECIAL + POSITIVE + NEGATIVE + NEUTRAL + TOPICS


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def sentiment_reward(prompts, completions, **_) -> list[float]:
    """(#positive - #negative) / max(4, #words): 1 needs at least four words, all positive."""
    out = []
    for text in completions:
        words = str(text).split()
        out.append((sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)) / max(4, len(words)))
    return out


def prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"review {' '.join(rng.choice(NEUTRAL, 2))} {rng.choice(TOPICS)} :" for _ in range(n)]


def write_world(root: Path, seed: int = 0) -> Path:
    """Write the tiny policy checkpoint (``root/model``) and prompts (``root/prompts.jsonl``, ``eval.jsonl``)."""
    from transformers import LlamaConfig


    tok = build_tokenizer()
    hf = LlamaConfig(vocab_size=len(vocabulary()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.eos_token_id)
    model = model_from_hf_config(hf, "causal_lm")
    params = init_params(model, jax.random.PRNGKey(seed), std=0.02)
    save_hf(model, params, root / "model", tokenizer=tok)
    for name, n, s in (("prompts.jsonl", 2048, seed), ("eval.jsonl", 64, seed + 1)):
        (root / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(n, s)))
    return root


def world_dir() -> Path:
    """The tiny world, built once (atomically) under ``$JODPO_CACHE`` (default ``~/.cache/jodpo``)."""
    root = Path(os.environ.get("JODPO_CACHE", Path.home() / ".cache" / "jodpo")) / f"tiny-world-v{VERSION}"
    if not (root / "prompts.jsonl").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".tmp-"))
        write_world(tmp)
        try:
            tmp.rename(root)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return root

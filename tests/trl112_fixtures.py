"""The tiny checkpoints TRL 1.12's golden numbers were recorded on (tests/golden/trl112_*.json), built the same way in
TRL 1.12's environment (scripts/record_trl112.py) and in the suite's (tests/test_trl112.py): the suite's tokenizer and
family configs (``hf_fixtures``), weights drawn with numpy from fixed seeds by parameter name (not torch's global
generator, nor the fixture list's order), so that both environments build the same models; ``fingerprint`` says
they did. The tokenizer gets a BOS of its own (the suite's is its EOS): TRL 1.12 looks for an EOS anywhere in prompt
and completion, so with BOS = EOS its EOS penalty never applies (docs/online_family.md); with a BOS of its own the
recorded step exercises the penalty and TRL's prompt BOS alike. Imports no jax: it runs in TRL 1.12's environment."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests import hf_fixtures

PROMPTS = ["the quick brown fox", "hello world, hello", "TL;DR: a short summary of the post",
           "online dpo samples two"]
SEEDS = {"policy": 0, "reference": 1, "reward": 2}  # per family: + 10 * its index in FAMILIES below
FAMILIES = ("neox", "llama", "qwen3_5")


def build_tokenizer(out: Path):
    tok = hf_fixtures.build_tokenizer(out)
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    tok.save_pretrained(out)
    return tok


def _fill(model, seed: int, like=None, scale: float = 0.08) -> None:
    """Weights from ``np.random.default_rng(seed)``, by sorted parameter name: matrices N(0, scale); vectors 1 (a
    norm's scale) or 0 (biases, DeltaNet's A_log and dt_bias) plus N(0, 0.05), never their init (Qwen3.5's A_log is
    drawn from torch's global generator). ``like``: a model whose weights these are a perturbation of (N(0, 0.02))."""
    import torch

    rng = np.random.default_rng(seed)
    base = None if like is None else dict(like.named_parameters())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if base is not None:
                value = base[name].numpy() + rng.normal(0.0, 0.02, shape)
            elif p.ndim >= 2:
                value = rng.normal(0.0, scale, shape)
            else:
                value = float("norm" in name) + rng.normal(0.0, 0.05, shape)
            p.copy_(torch.tensor(value, dtype=torch.float32))


def build(root: Path, family: str) -> dict[str, Path]:
    """{"policy", "reference", "reward", "tokenizer"} directories of ``family``'s golden models under ``root``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = Path(root)
    tok_dir = root / "tokenizer"
    tok = build_tokenizer(tok_dir) if not tok_dir.exists() else None
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = hf_fixtures.family_configs(tok.pad_token_id, tok.eos_token_id)[family]
    cfg.num_labels = 1
    offset = 10 * FAMILIES.index(family)
    out = {"tokenizer": tok_dir}
    policy = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _fill(policy, SEEDS["policy"] + offset)
    reference = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _fill(reference, SEEDS["reference"] + offset, like=policy)
    reward = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    _fill(reward, SEEDS["reward"] + offset)
    for name, model in (("policy", policy), ("reference", reference), ("reward", reward)):
        out[name] = root / f"{family}-{name}"
        model.save_pretrained(out[name])
        tok.save_pretrained(out[name])
    return out


def fingerprint(path: Path) -> float:
    """Sum of |w| over a checkpoint's tensors, in float64: equal in both environments when the models are."""
    from safetensors.numpy import load_file

    tensors = load_file(str(next(Path(path).glob("*.safetensors"))))
    return float(sum(np.abs(t.astype(np.float64)).sum() for t in tensors.values()))

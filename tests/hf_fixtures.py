"""Tiny Hugging Face checkpoints and a tokenizer, built locally (nothing is downloaded).

Each family variant exercises a different switch of jodpo's decoder: Pythia's parallel residual and
partial rotary, Llama-3 RoPE scaling with grouped-query attention, tied embeddings, Mistral's sliding
window, Qwen2's q/k/v biases, Qwen3's q/k norms (with an explicit head_dim and a sliding-window layer), Qwen3.5's
Gated DeltaNet and gated-attention layers (alternating), Gemma 2's (1 + w) norms, four a layer, scaled embeddings,
GeGLU, query_pre_attn_scalar and soft-capping (caps small enough to bite on these weights), Gemma 3's q/k norms and
its local layers' own RoPE base beside scaled global RoPE, SmolLM3's NoPE layer, OLMo 2's norms after attention and MLP
and q/k norms over the whole projections, OLMo 3's three sliding layers to one global with YaRN. Every sliding window
(4 to 6 slots) is shorter than the prompts the tests feed them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 320  # the model's embedding rows; the tokenizer has fewer, as Pythia's 50304 vs 50277
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "TL;DR: a short summary of the post",
    "SUBREDDIT: r/relationships TITLE: advice needed POST: my friend and I", "hello world, hello jax",
    "online dpo samples two completions per prompt and prefers the higher reward",
] * 20


def build_tokenizer(out: Path):
    """A byte-level BPE tokenizer trained on a few sentences, saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", padding_side="left")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(out)
    return fast


FAMILIES = ("neox", "neox_seq", "llama", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma2",
            "gemma3", "smollm3", "olmo2", "olmo3", "gemma4", "qwen3_moe", "olmoe", "qwen3_5_moe")  # family_configs'
# keys, in order
# For the tests of the decoder's own paths (the shared prompt, the cache, rematerialisation): the families less the
# two whose layers are another family's mixer with Qwen3-MoE's feed-forward (OLMoE: OLMo 2's attention; Qwen3.5-MoE:
# Qwen3.5's layers and a shared expert), which those paths treat alike; their mapping, routing and decoding are
# checked in every family test (logits, reward heads, greedy decoding, export) and tests/test_moe.py
DECODER_FAMILIES = tuple(f for f in FAMILIES if f not in ("olmoe", "qwen3_5_moe"))


def family_configs(pad_id: int, eos_id: int) -> dict:
    """transformers configs of the tiny variants, keyed by fixture name."""
    from transformers import (Gemma2Config, Gemma3TextConfig, Gemma4TextConfig, GPTNeoXConfig, LlamaConfig,
                              MistralConfig, Olmo2Config, Olmo3Config, OlmoeConfig, Qwen2Config, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=128, pad_token_id=pad_id, eos_token_id=eos_id,
                  bos_token_id=eos_id)
    return {
        "neox": GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True, **common),
        "neox_seq": GPTNeoXConfig(rotary_pct=0.5, use_parallel_residual=False, attention_bias=False, **common),
        "llama": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                             **common),
        "llama_tied": LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True, head_dim=32, **common),
        "mistral": MistralConfig(num_key_value_heads=2, sliding_window=6, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        # layer 0 full, layer 1 a window of 4 (layers from max_window_layers on slide)
        "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, use_sliding_window=True,
                             sliding_window=4, max_window_layers=1, **common),
        # the hybrid: DeltaNet and gated attention alternating (one scan of two-layer periods), value heads grouped
        # two per key head, key and value head dims unlike, partial RoPE over a quarter of each attention head
        "qwen3_5": Qwen3_5TextConfig(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                     layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                                     linear_conv_kernel_dim=4, **{**common, "num_hidden_layers": 4}),
        "gemma2": Gemma2Config(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=1.0,
                               final_logit_softcapping=2.0, **common),
        "gemma3": Gemma3TextConfig(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1000.0}}, **common),
        # layer 1 without RoPE (NoPE) and sliding (transformers' default layer_types with use_sliding_window)
        "smollm3": SmolLM3Config(num_key_value_heads=2, no_rope_layers=[1, 0], use_sliding_window=True,
                                 sliding_window=5, tie_word_embeddings=False, **common),
        # no norms before attention or MLP, q/k norms over the whole projections (two kv heads: k_norm over 2 x 16)
        "olmo2": Olmo2Config(num_key_value_heads=2, **common),
        # three sliding layers (window 4) and a global one with YaRN (its attention factor), the sliding ones at the
        # plain base
        "olmo3": Olmo3Config(num_key_value_heads=2, sliding_window=4,
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                              "full_attention": {"rope_type": "yarn", "rope_theta": 100.0,
                                                                 "factor": 4.0, "original_max_position_embeddings": 32,
                                                                 "attention_factor": 1.3}},
                             **{**common, "num_hidden_layers": 4}),
        # everything its config allows at once: a sliding layer (window 5, head_dim 16, two kv heads) and a global one
        # (head_dim 32, one kv head, values = keys, proportional RoPE over a quarter), per-layer embeddings (8 a
        # layer), the last two layers reusing their keys and values with double-wide MLPs, a soft-cap that bites. Four
        # layers, each of its own kind (one scan body of four: every Gemma 4 test compiles it); which earlier layer a
        # reader reads when there are several of its type: tests/test_gemma4.py
        "gemma4": Gemma4TextConfig(num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                                   attention_k_eq_v=True, sliding_window=5, num_kv_shared_layers=2,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                   use_double_wide_mlp=True, final_logit_softcapping=5.0,
                                   **{**common, "num_hidden_layers": 4}),
        # mixtures of experts: 4 experts of width 32, two a token, renormalised; OLMoE's 6 of width 32, three a token,
        # not renormalised, with its q/k norms over the whole projections
        "qwen3_moe": Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
                                    **common),
        "olmoe": OlmoeConfig(num_key_value_heads=2, num_experts=6, num_experts_per_tok=3,
                             **{**common, "intermediate_size": 32}),
        # Qwen3.5's hybrid (DeltaNet and gated attention alternating: one scan of two-layer periods, as the real
        # models' DDDS x 10) with 4 experts of 32, two a token, and a shared expert of 48 behind its sigmoid gate
        "qwen3_5_moe": Qwen3_5MoeTextConfig(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                            layer_types=["linear_attention", "full_attention"] * 2,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                            num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                            **{k: v for k, v in common.items() if k != "intermediate_size"}
                                            | {"num_hidden_layers": 4}),
    }


def gemma4_moe_config(pad_id: int, eos_id: int):
    """A tiny Gemma 4 26B-A4B (``enable_moe_block``; not in ``FAMILIES``, so that only tests/test_moe.py pays for it):
    a sliding and a global layer as the 26B's (values = keys, proportional RoPE over a quarter), no per-layer
    embeddings, no KV sharing; in each layer a dense MLP of 48 beside 6 experts of 16, two a token."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                            attention_k_eq_v=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                            num_kv_shared_layers=0, hidden_size_per_layer_input=0, intermediate_size=48,
                            enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=16,
                            final_logit_softcapping=5.0, max_position_embeddings=128, pad_token_id=pad_id,
                            eos_token_id=eos_id, bos_token_id=eos_id)


def qwen3_next_config(pad_id: int, eos_id: int):
    """A tiny Qwen3-Next (not in ``FAMILIES``: tests/test_moe.py's): DeltaNet and gated attention alternating, two
    value heads a key head (its fused projections' groups), 4 experts of 32, two a token, not renormalised, and a
    shared expert of 48 behind its sigmoid gate, in every second layer (decoder_sparse_step 2: the others a dense MLP
    of 128)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                           decoder_sparse_step=2,
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                           norm_topk_prob=False, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False,
                           pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id)


def build_moe_extra(name: str, root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """The causal LM and reward model (random, ``randomize``d) of ``gemma4_moe_config`` (``name`` "gemma4_moe") or
    ``qwen3_next_config`` ("qwen3_next") with the fixtures' tokenizer: ``{"causal_lm": dir, "reward": dir}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = {"gemma4_moe": gemma4_moe_config, "qwen3_next": qwen3_next_config}[name](tok.pad_token_id, tok.eos_token_id)
    cfg.num_labels = 1
    torch.manual_seed(7)
    out = {}
    for task, cls in (("causal_lm", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)):
        out[task] = root / f"{name}-{task}"
        randomize(cls.from_config(cfg, dtype=torch.float32)).save_pretrained(out[task])
        tok.save_pretrained(out[task])
    return out


def _register_gemma4_classifier():
    """transformers has no Gemma4ForSequenceClassification: the tests' is its generic sequence classifier over the text
    model (``score.weight`` on the last non-pad token's hidden state), as transformers defines every other family's
    (Gemma3TextForSequenceClassification), registered with AutoModelForSequenceClassification in the test processes."""
    from transformers import AutoModelForSequenceClassification, Gemma4TextConfig
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.gemma4.modeling_gemma4 import Gemma4PreTrainedModel

    class Gemma4ForSequenceClassification(GenericForSequenceClassification, Gemma4PreTrainedModel):
        config_class = Gemma4TextConfig
        # transformers decides this by reading the class's module's source for its experts decorator, which
        # modeling_gemma4 has (its other classes answer True) and this file does not
        _can_set_experts_implementation_cached_value = True

    AutoModelForSequenceClassification.register(Gemma4TextConfig, Gemma4ForSequenceClassification, exist_ok=True)


def _register_moe_classifiers():
    """transformers has no OLMoE or Qwen3.5-MoE sequence classifier either: the tests' are its generic one over their
    text models, as Qwen3MoeForSequenceClassification is Qwen3-MoE's."""
    from transformers import AutoModelForSequenceClassification, OlmoeConfig, Qwen3_5MoeTextConfig
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.olmoe.modeling_olmoe import OlmoePreTrainedModel
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoePreTrainedModel

    class OlmoeForSequenceClassification(GenericForSequenceClassification, OlmoePreTrainedModel):
        config_class = OlmoeConfig
        _can_set_experts_implementation_cached_value = True

    class Qwen3_5MoeForSequenceClassification(GenericForSequenceClassification, Qwen3_5MoePreTrainedModel):
        config_class = Qwen3_5MoeTextConfig
        _can_set_experts_implementation_cached_value = True

    AutoModelForSequenceClassification.register(OlmoeConfig, OlmoeForSequenceClassification, exist_ok=True)
    AutoModelForSequenceClassification.register(Qwen3_5MoeTextConfig, Qwen3_5MoeForSequenceClassification,
                                                exist_ok=True)


try:
    _register_moe_classifiers()
    _register_gemma4_classifier()
except ImportError:  # no torch (a subprocess without it)
    pass


def randomize(model):
    """``model`` (torch) with larger random weights than HF's init, so that differences show up: matrices normal(0,
    0.08), vectors (norms, biases) and Gemma 4's layer scalars (buffers, saved with the weights) moved by
    normal(0, 0.05)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(torch.randn_like(b) * 0.05)
    return model


def checkpoint_dirs(root: Path) -> dict[str, dict[str, Path]]:
    """{name: {"causal_lm": dir, "reward": dir}}: where ``build_checkpoints(root)`` writes them."""
    return {name: {task: root / f"{name}-{task}" for task in ("causal_lm", "reward")} for name in FAMILIES}


def build_checkpoints(root: Path) -> dict[str, dict[str, Path]]:
    """{name: {"causal_lm": dir, "reward": dir}} of tiny random checkpoints sharing one tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = build_tokenizer(root / "tokenizer")
    out = {}
    configs = family_configs(tok.pad_token_id, tok.eos_token_id)
    assert tuple(configs) == FAMILIES, tuple(configs)
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(i)
        dirs = {}
        for task, cls in (("causal_lm", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)):
            cfg.num_labels = 1
            model = randomize(cls.from_config(cfg, dtype=torch.float32))
            d = root / f"{name}-{task}"
            model.save_pretrained(d)
            tok.save_pretrained(d)
            dirs[task] = d
        out[name] = dirs
    return out


def build_neox_pair(root: Path, tokenizer_dir: Path, vocab: int = 640, intermediate: int = 256) -> dict[str, Path]:
    """{"causal_lm": dir, "reward": dir}: a Pythia-shaped pair (GPT-NeoX, hidden 64, 2 layers) a little wider than
    ``build_checkpoints``' (``vocab`` embedding rows, an MLP of ``intermediate``), with the tokenizer in
    ``tokenizer_dir``; HF's own initialisation, as a TL;DR run starts from real weights."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=intermediate, max_position_embeddings=2048, rotary_pct=0.25,
                        use_parallel_residual=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, hidden_dropout=0.0, attention_dropout=0.0, num_labels=1)
    out = {}
    classes = {"causal_lm": GPTNeoXForCausalLM, "reward": GPTNeoXForSequenceClassification}
    for seed, (task, cls) in enumerate(classes.items()):
        torch.manual_seed(seed)
        out[task] = root / f"neox-wide-{task}"
        cls(cfg).save_pretrained(out[task])
        tok.save_pretrained(out[task])
    return out


def padded_batch(rng: np.random.Generator, lengths, pad_id: int, side: str, low: int = 3, high: int = 290):
    """Random token rows of the given lengths, padded left or right to the longest."""
    L = max(lengths)
    ids = np.full((len(lengths), L), pad_id, np.int32)
    mask = np.zeros((len(lengths), L), np.int32)
    for b, n in enumerate(lengths):
        row = rng.integers(low, high, n)
        sl = slice(L - n, L) if side == "left" else slice(0, n)
        ids[b, sl], mask[b, sl] = row, 1
    return ids, mask


def prompt_dataset(root: Path, chat: bool = False, preference: bool = False, instructions: bool = False,
                   words: tuple[int, int] = (3, 9)) -> Path:
    """A local prompt dataset (train.jsonl: 16 rows, test.jsonl: 8) with reference completions (``preference``:
    with chosen/rejected columns too, as open-instruct's TL;DR dataset has; ``instructions``: chat prompts with
    IFEval instructions and their columns, as jodpo.tasks.instructions writes them). A post has ``words`` [low,
    high) words (TL;DR's posts: a hundred)."""
    rng = np.random.default_rng(0)
    vocabulary = " ".join(CORPUS[:5]).split()
    root.mkdir()
    for split, n in (("train", 16), ("test", 8)):
        rows = []
        for i in range(n):
            text = " ".join(rng.choice(vocabulary, rng.integers(*words)))
            if instructions:
                from jodpo.tasks.instructions import build_rows

                passage = " ".join(rng.choice(vocabulary, 10))
                [row] = build_rows([(f"fixture-{i}", passage)], "train" if split == "train" else "eval", seed=i)
                rows.append(row | {"completion": " " + " ".join(rng.choice(vocabulary, 4))})
                continue
            prompt = [{"role": "user", "content": text}] if chat else f"SUBREDDIT: r/test POST: {text} TL;DR:"
            rows.append({"prompt": prompt, "completion": " " + " ".join(rng.choice(vocabulary, 4))})
            if preference:
                rows[-1] |= {"chosen": rows[-1]["completion"], "rejected": " lazy dog"}
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root

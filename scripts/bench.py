"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

  python scripts/bench.py sample [--batch 16] [--new-tokens 53] [--prompt-len 64] [--repeats 5] [--out F.json]
  python scripts/bench.py train [--steps 5] [--warmup 2] [--no-trl] [--trl-gradient-checkpointing]
                                [--fixture DIR] [--out F.json]  (shapes: --hidden --layers --heads --vocab ...)

``sample``: jodpo's sampler vs transformers' ``generate`` (KV cache on) on the same random
Pythia-70m-shaped GPT-NeoX (hidden 512, 6 layers, 8 heads, vocab 50304), batch and lengths, fp32 on the
CPU. The two alternate, so both see the same machine; the median of ``--repeats`` runs is reported.
No EOS is set, so every row generates all the new tokens in both.

``train``: jodpo's real online DPO step (``train_step.jit_online_step``: sample two completions per prompt,
score them on device with the reward model, update) vs TRL 1.16's ``OnlineDPOTrainer`` step on one fixture
built here (a Pythia-70m-shaped policy and reward model with random weights, a 50304-word tokenizer saved
with both, TL;DR-like prompts of about 70 tokens). Each side runs in its own long-lived worker process
(so each has its own peak RSS); the parent alternates one jodpo step, one TRL step, ... Then jodpo's
step is timed piece by piece, FLOPs are counted analytically against the matmul peak measured here, and
the sampler is compared with ``generate`` on the same model and batch. Shapes are flags, so the test
runs the same code on a tiny model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Idle OpenMP threads of torch otherwise spin after each call and steal the cores from whatever runs next
# (measured here: both jodpo and transformers ran 25-40% slower when alternated with spinning threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# jax/jodpo and torch/trl are imported inside functions: the TRL worker must not carry jax, nor the reverse
# more than jodpo itself loads (its checkpoint loader imports transformers, which imports torch).

PYTHIA_70M = dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  intermediate_size=2048, rotary_pct=0.25, max_position_embeddings=2048)
EOS, PAD, UNK = "<|endoftext|>", "<|padding|>", "<|unk|>"  # ids 0, 1, 2 (Pythia: EOS 0, pad 1)
FIXED = ["SUBREDDIT", "TITLE", "POST", "TL", "DR", "r", ":", ";", "/", ".", ","]
TRL_BETA, LR, TEMPERATURE, MISSING_EOS_PENALTY, MAX_LENGTH = 0.1, 5e-7, 0.9, 1.0, 512  # TRL defaults / tldr


def build_pythia_70m_shaped(out: Path, seed: int = 0) -> Path:
    """A random GPT-NeoX with Pythia-70m's shapes, saved with transformers (nothing is downloaded)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    GPTNeoXForCausalLM(GPTNeoXConfig(**PYTHIA_70M)).save_pretrained(out)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# sample: jodpo.sample vs transformers' generate
# --------------------------------------------------------------------------------------------------


def compare_sampler(path: Path, ids: np.ndarray, T: int, repeats: int) -> dict:
    """jodpo.sample vs HF generate on ``ids`` (no padding, no EOS: every row makes T tokens), alternated."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import jodpo

    model, params = jodpo.load_model(str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    B, P = ids.shape
    mask = np.ones_like(ids)
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=TEMPERATURE, pad_token_id=0)
    sample = jax.jit(jodpo.sample, static_argnums=(0, 5))

    def run_jodpo(i):
        out = sample(model, params, ids, mask, jax.random.key(i), cfg)
        assert int(out.mask.sum()) == B * T
        out.tokens.block_until_ready()

    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask)

    def run_hf(i):
        torch.manual_seed(i)
        with torch.no_grad():
            out = hf.generate(input_ids=t_ids, attention_mask=t_mask, do_sample=True, temperature=TEMPERATURE,
                              top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=0,
                              eos_token_id=None, use_cache=True)
        assert out.shape == (B, P + T)

    compile_s = _timed(lambda: run_jodpo(0))
    run_hf(0)  # warm-up
    times = {"jodpo": [], "hf": []}
    for i in range(1, repeats + 1):
        times["jodpo"].append(_timed(lambda: run_jodpo(i)))
        times["hf"].append(_timed(lambda: run_hf(i)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": B, "prompt_len": P, "new_tokens": T, "repeats": repeats,
            "jodpo_compile_plus_first_s": compile_s, "jodpo_s": med["jodpo"], "hf_generate_s": med["hf"],
            "jodpo_tokens_per_s": B * T / med["jodpo"], "hf_generate_tokens_per_s": B * T / med["hf"],
            "speedup": med["hf"] / med["jodpo"], "all_times": times}


def bench_sample(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_pythia_70m_shaped(Path(tmp) / "policy")
        ids = np.random.default_rng(0).integers(0, 50000, (args.batch, args.prompt_len)).astype(np.int32)
        out = compare_sampler(path, ids, args.new_tokens, args.repeats)
    return {"benchmark": "sample", "model": "pythia-70m-shaped GPT-NeoX (random), fp32", **out}


# --------------------------------------------------------------------------------------------------
# train: the fixture (tokenizer, policy, reward model, prompts), built locally
# --------------------------------------------------------------------------------------------------


def _words(n: int) -> list[str]:
    """n distinct lowercase pseudo-words (consonant-vowel syllables), none equal to a fixed token."""
    syl = [c + v for c in "bdfghjklmnprstvwz" for v in "aeiou"]  # 85 syllables
    out, k = [], 1
    while len(out) < n:
        for idx in np.ndindex(*(len(syl),) * k):
            out.append("".join(syl[i] for i in idx))
            if len(out) == n:
                break
        k += 1
    return out


def build_tokenizer(vocab: int):
    """A word-level tokenizer of exactly ``vocab`` entries: EOS 0, pad 1, unk 2, the prompt's fixed tokens,
    then pseudo-words. Decoding joins words with spaces, so decode -> encode round-trips (TRL's RM path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [EOS, PAD, UNK] + FIXED
    names += _words(vocab - len(names))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, padding_side="left"), names[len(FIXED) + 3:]


def make_prompts(words: list[str], n: int, length: int, seed: int = 0) -> list[str]:
    """TL;DR-like prompts of ``length - 6 .. length`` tokens (the lengths of a padded batch vary, as in TL;DR)."""
    rng = np.random.default_rng(seed)
    pick = lambda k: " ".join(words[i] for i in rng.integers(0, len(words), k))
    out = []
    for _ in range(n):
        L = int(rng.integers(max(16, length - 6), length + 1)) if length >= 16 else length
        n_title = min(6, max(1, (L - 14) // 4))
        n_post = max(1, L - 13 - n_title)  # 13 fixed tokens: SUBREDDIT : r / w TITLE : POST : TL ; DR :
        out.append(f"SUBREDDIT: r/{pick(1)}\n\nTITLE: {pick(n_title)}\n\nPOST: {pick(n_post)}\n\nTL;DR:")
    return out


def build_fixture(out: Path, a) -> dict:
    """policy/ and reward/ (a GPT-NeoX causal LM and sequence classifier, one tokenizer) and prompts.json.
    Reused when ``out`` already holds a fixture of the same shape."""
    spec = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads, prompts=a.prompts,
                prompt_len=a.prompt_len)
    if (out / "spec.json").is_file() and json.loads((out / "spec.json").read_text()) == spec:
        return spec
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tok, words = build_tokenizer(a.vocab)
    cfg = dict(PYTHIA_70M, vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
               num_attention_heads=a.heads, intermediate_size=4 * a.hidden, eos_token_id=0, bos_token_id=0,
               pad_token_id=1)
    for seed, name, cls in ((0, "policy", GPTNeoXForCausalLM), (1, "reward", GPTNeoXForSequenceClassification)):
        torch.manual_seed(seed)
        cls(GPTNeoXConfig(**cfg, num_labels=1)).save_pretrained(out / name)
        tok.save_pretrained(out / name)
    prompts = make_prompts(words, a.prompts, a.prompt_len)
    (out / "prompts.json").write_text(json.dumps(prompts))
    (out / "spec.json").write_text(json.dumps(spec))
    return spec


# --------------------------------------------------------------------------------------------------
# train: FLOPs, counted analytically (GPT-NeoX: q, k, v, o and a 4x MLP per layer)
# --------------------------------------------------------------------------------------------------


def _fwd(d: dict, tokens: float, pairs: float, head_positions: float) -> float:
    """Forward FLOPs: 2 * matmul params per token through the layers, 4 * D per attended (query, key) pair
    per layer (QK^T and PV), 2 * D * V per position where the LM head runs."""
    D, F, L, V = d["hidden"], 4 * d["hidden"], d["layers"], d["vocab"]
    return 2 * L * (4 * D * D + 2 * D * F) * tokens + 4 * D * L * pairs + 2 * D * V * head_positions


def step_flops(d: dict, p: np.ndarray, c: np.ndarray, P: int, T: int) -> dict:
    """GFLOP of each piece of one online DPO step. ``useful``: the work the algorithm needs (each prompt
    once, causal attention over real tokens, the LM head only where a log-prob is read); ``jodpo``: what
    jodpo's current step executes (every row of the padded [2B, P + T] block, dense attention);
    ``trl``: what TRL 1.16 executes (two copies of each prompt, the LM head over prompt positions too).
    p: i32[B] real prompt lengths; c: i32[2B] completion lengths (block layout); P, T: padded widths."""
    B = len(p)
    pp = np.concatenate([p, p])
    tri = lambda n: n * (n + 1) / 2
    # Policy / reference forward: inputs prompt + completion minus its last token, head at c positions.
    n_in = pp + c - 1
    useful = _fwd(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), c.sum())
    jodpo = _fwd(d, 2 * B * (P + T), 2 * B * (P + T) ** 2, 2 * B * T)
    trl = _fwd(d, 2 * B * (P + T), 2 * B * tri(P + T), 2 * B * (P + T))  # SDPA causal; logits everywhere
    # Reward model: prompt + completion (its value is read at the last token); no LM head.
    rm_useful = _fwd(d, p.sum() + c.sum(), tri(p).sum() + (tri(pp + c) - tri(pp)).sum(), 0)
    rm_jodpo = _fwd(d, 2 * B * (P + T), 2 * B * (P + T) ** 2, 0)
    # Sampling: prefill, then c - 1 one-token forwards per completion over the KV cache (the last token's
    # forward is skipped). jodpo attends over every cache slot (P + T) and prefills both copies of a prompt.
    s_useful = _fwd(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), B + (c - 1).sum())
    steps = int(c.max()) - 1
    s_jodpo = _fwd(d, 2 * B * P, 2 * B * P * P, 2 * B) + _fwd(d, 2 * B * steps, 2 * B * steps * (P + T),
                                                               2 * B * steps)
    s_trl = _fwd(d, 2 * B * P, 2 * B * tri(P), 2 * B) + _fwd(d, 2 * B * steps,
                                                              2 * B * sum(P + t for t in range(1, steps + 1)),
                                                              2 * B * steps)
    g = lambda x: float(x) / 1e9
    out = {
        "sampling": {"useful": g(s_useful), "jodpo": g(s_jodpo), "trl": g(s_trl)},
        "reward_scoring": {"useful": g(rm_useful), "jodpo": g(rm_jodpo), "trl": g(rm_jodpo)},
        "reference_logprobs": {"useful": g(useful), "jodpo": g(jodpo), "trl": g(trl)},
        "policy_fwd_bwd": {"useful": g(3 * useful), "jodpo": g(3 * jodpo), "trl": g(3 * trl)},
        "optimizer": {"useful": 0.0, "jodpo": 0.0, "trl": 0.0},
    }
    out["step"] = {k: sum(v[k] for v in out.values()) for k in ("useful", "jodpo", "trl")}
    out["lm_head_over_prompt_trl"] = g(4 * 2 * d["hidden"] * d["vocab"] * 2 * B * P)  # policy fwd+bwd, ref
    return out


# --------------------------------------------------------------------------------------------------
# train: the workers (one process per side, driven over stdin/stdout, one JSON line per answer)
# --------------------------------------------------------------------------------------------------


class Channel:
    """The worker's side: commands on stdin, answers on the original stdout; anything else that prints
    (libraries, warnings) goes to stderr, so it cannot corrupt the protocol."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def read(self) -> str:
        return sys.stdin.readline().strip() or "quit"

    def send(self, **msg):
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


FIRST_CALL_S: dict[str, float] = {}  # per timed piece: the first call's seconds (compilation included)


def _rss_mib() -> float:
    """Resident memory now (the peak is ``_maxrss_mib``)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _median_time(fn, repeats: int, name: str | None = None) -> float:
    first = _timed(fn)  # warm-up (compilation)
    if name:
        FIRST_CALL_S[name] = first
    return statistics.median(_timed(fn) for _ in range(repeats))


def _jax_matmul_peak(repeats: int = 5, n: int = 2048) -> float:
    import jax

    a = jax.random.normal(jax.random.key(0), (n, n), np.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), np.float32)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / _median_time(lambda: mm(a, b).block_until_ready(), repeats) / 1e9


def worker_jodpo(spec: dict, ch: Channel):
    import jax
    import jax.numpy as jnp
    from datasets import Dataset

    import jodpo
    from jodpo import data as D
    from jodpo import train_step as ts
    from jodpo.losses import completion_logprobs, online_dpo_loss

    t0 = time.perf_counter()
    fx, B, T = Path(spec["fixture"]), spec["batch"], spec["new_tokens"]
    tok = jodpo.load_tokenizer(str(fx / "policy"))
    model, ref = jodpo.load_model(str(fx / "policy"))
    model = model.replace(remat="none")  # fp32, no gradient checkpointing (as the TRL side)
    rm, rm_params = jodpo.load_model(str(fx / "reward"), task="reward")
    eos = tuple(dict.fromkeys([*model.eos_token_ids, tok.eos_token_id]))  # as jodpo.train: model + tokenizer
    data = D.prepare_prompts(Dataset.from_dict({"prompt": json.loads((fx / "prompts.json").read_text())}), tok,
                             MAX_LENGTH)
    P = max(len(x) for x in data.ids)  # one prompt bucket: the longest prompt (fixed shape, no recompiles)
    cfg = ts.StepConfig(
        model=model, optimizer=ts.OptimizerConfig(learning_rate=LR, total_steps=10 ** 6),
        sampling=jodpo.SamplingConfig(max_new_tokens=T, temperature=TEMPERATURE, eos_token_ids=eos,
                                      pad_token_id=tok.pad_token_id),
        beta=TRL_BETA, loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH,
        reward_model=rm)
    state = ts.init_state(cfg, ref, jax.random.key(0))
    batch = lambda k: D.prompt_batch([data.ids[i] for i in D.batch_indices(len(data), B, 0, k)], 1, (P,),
                                     tok.pad_token_id)
    ch.send(ready=True, load_s=time.perf_counter() - t0, eos_token_ids=list(eos), prompt_width=P,
            peak_rss_mib=_maxrss_mib())
    k, last = 0, None
    while (cmd := ch.read()) != "quit":
        if cmd == "step":
            ids, mask = batch(k)
            cache_before = ts.jit_online_step._cache_size()
            old = state
            t = time.perf_counter()
            state, metrics, samples, raw = ts.jit_online_step(cfg, state, ref, rm_params, ids, mask)
            jax.block_until_ready((state, metrics, samples, raw))
            dt = time.perf_counter() - t
            ch.send(s=dt, completion_tokens=int(samples.mask.sum()), completion_width=int(samples.mask.shape[-1]),
                    prompt_width=int(ids.shape[-1]), prompt_tokens=int(mask.sum()),
                    prompt_lens=np.asarray(mask).sum(-1).ravel().tolist(),
                    completion_lens=np.asarray(samples.mask).sum(-1).ravel().tolist(),
                    compiled=ts.jit_online_step._cache_size() - cache_before,
                    donated=bool(jax.tree.leaves(old.params)[0].is_deleted()), loss=float(metrics["loss"]),
                    peak_rss_mib=_maxrss_mib(), rss_mib=_rss_mib())
            last, k = (ids, mask, samples), k + 1
        elif cmd == "rss":
            ch.send(peak_rss_mib=_maxrss_mib(), torch_loaded="torch" in sys.modules)
        elif cmd == "peak":
            ch.send(matmul_peak_gflops=_jax_matmul_peak())
        elif cmd == "breakdown":
            ch.send(**_jodpo_breakdown(jax, jnp, ts, cfg, state, ref, rm_params, *last, spec["repeats"],
                                       completion_logprobs, online_dpo_loss))
        else:
            ch.send(error=f"unknown command {cmd!r}")
    ch.send(bye=True)


def _jodpo_breakdown(jax, jnp, ts, cfg, state, ref, rm_params, ids, mask, samples, repeats, completion_logprobs,
                     online_dpo_loss) -> dict:
    """The step's pieces, each under its own jit, on the last step's inputs."""
    block = jax.block_until_ready
    model, eos = cfg.model, cfg.sampling.eos_token_ids
    twice = lambda x: jnp.concatenate([x[0], x[0]], 0)
    ids2, mask2, toks, tmask = twice(ids), twice(mask), samples.tokens[0], samples.mask[0]
    out = {"sampling_s": _median_time(lambda: block(ts.jit_sample_completions(cfg, state, ids, mask)), repeats,
                                      "sampling")}
    rewards = ts.jit_score_completions(cfg, rm_params, ids, mask, samples)
    out["reward_scoring_s"] = _median_time(
        lambda: block(ts.jit_score_completions(cfg, rm_params, ids, mask, samples)), repeats, "reward_scoring")
    ref_lp = jax.jit(lambda p, *x: completion_logprobs(model, p, *x, max_length=cfg.max_length))
    out["reference_logprobs_s"] = _median_time(lambda: block(ref_lp(ref, ids2, mask2, toks, tmask)), repeats,
                                                 "reference_logprobs")
    lp = ref_lp(ref, ids2, mask2, toks, tmask)

    def loss(params, lp):
        return online_dpo_loss(model, params, None, ids2, mask2, toks, tmask, rewards[0], beta=TRL_BETA,
                               loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, eos_token_ids=eos,
                               max_length=cfg.max_length, ref_logprobs=lp)

    fwd_bwd, fwd_only = jax.jit(jax.value_and_grad(loss, has_aux=True)), jax.jit(loss)
    out["policy_fwd_bwd_s"] = _median_time(lambda: block(fwd_bwd(state.params, lp)), repeats, "policy_fwd_bwd")
    out["policy_fwd_only_s"] = _median_time(lambda: block(fwd_only(state.params, lp)), repeats, "policy_fwd_only")
    (_, metrics), grads = fwd_bwd(state.params, lp)
    # The LM head + log-softmax alone (forward and backward) at the completion positions.
    h = jnp.zeros((ids2.shape[0], toks.shape[1], model.hidden_size), jnp.float32) + 0.01
    w = state.params["lm_head"]

    def head(w, h):
        logits = jnp.einsum("bcd,vd->bcv", h, w)
        picked = jnp.take_along_axis(logits, toks[..., None], -1)[..., 0]
        return (picked - jax.nn.logsumexp(logits, -1)).sum()

    head_grad = jax.jit(jax.grad(head, (0, 1)))
    out["lm_head_fwd_bwd_s"] = _median_time(lambda: block(head_grad(w, h)), repeats, "lm_head_fwd_bwd")
    apply = jax.jit(ts.apply_gradients, static_argnums=0, donate_argnums=1)
    st = [jax.tree.map(jnp.copy, state)]

    def opt():
        st[0] = block(apply(cfg, st[0], grads, metrics)[0])

    out["optimizer_s"] = _median_time(opt, repeats, "optimizer")
    return out | {"first_call_s": dict(FIRST_CALL_S)}


def worker_trl(spec: dict, ch: Channel):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    t0 = time.perf_counter()
    fx = Path(spec["fixture"])
    tok = AutoTokenizer.from_pretrained(fx / "policy")
    policy = AutoModelForCausalLM.from_pretrained(fx / "policy", dtype=torch.float32)
    rm = AutoModelForSequenceClassification.from_pretrained(fx / "reward", dtype=torch.float32, num_labels=1)
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")  # save_strategy "no": stays empty; removed on quit
    args = OnlineDPOConfig(
        output_dir=out_dir, per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, max_new_tokens=spec["new_tokens"], temperature=TEMPERATURE, beta=TRL_BETA,
        loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH, learning_rate=LR,
        bf16=False, fp16=False, gradient_checkpointing=spec["trl_gradient_checkpointing"], use_cpu=True,
        report_to=[], logging_steps=10 ** 6, max_steps=10 ** 6, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    prompts = Dataset.from_dict({"prompt": json.loads((fx / "prompts.json").read_text())})
    trainer = OnlineDPOTrainer(model=policy, ref_model=None, reward_funcs=rm, reward_processing_classes=tok,
                               args=args, processing_class=tok, train_dataset=prompts)
    parts, seen = {}, {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            if name == "generate":
                seen.update(prompt_width=int(out[0].shape[1]), prompt_tokens=int(out[1].sum()),
                            completion_width=int(out[2].shape[1]), completion_tokens=int(out[3].sum()))
            if name == "training_step":
                parts["training_step_end"] = time.perf_counter()
            return out
        return wrapper

    fwd = trainer._forward
    calls = []

    def forward(model, *a, **k):  # first call: the policy (with grad), second: the reference
        name = "policy_forward" if not calls else "reference_forward"
        calls.append(name)
        return timed(name, fwd)(model, *a, **k)

    trainer._generate = timed("generate", trainer._generate)
    trainer._forward = forward
    trainer._calculate_rewards_from_functions = timed("reward_scoring", trainer._calculate_rewards_from_functions)
    trainer.accelerator.backward = timed("policy_backward", trainer.accelerator.backward)
    trainer.training_step = timed("training_step", trainer.training_step)

    class Driver(TrainerCallback):
        """Blocks the real Trainer loop at the start of each step until the parent says "step"; the time from
        on_step_begin to on_step_end is one whole optimizer step (generate, score, loss, backward, clip,
        optimizer.step, scheduler, zero_grad); batch fetching and logging fall outside it."""

        def on_train_begin(self, *a, **k):
            ch.send(ready=True, load_s=time.perf_counter() - t0, eos_token_ids=list(trainer.eos_token_ids),
                    attn_implementation=policy.config._attn_implementation, torch_threads=torch.get_num_threads(),
                    gradient_checkpointing=bool(policy.is_gradient_checkpointing), peak_rss_mib=_maxrss_mib())

        def on_step_begin(self, *a, **k):
            while (cmd := ch.read()) != "step":
                if cmd == "rss":
                    ch.send(peak_rss_mib=_maxrss_mib())
                elif cmd == "peak":
                    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
                    ch.send(matmul_peak_gflops=2 * 2048 ** 3 / _median_time(lambda: torch.mm(x, y), 5) / 1e9)
                elif cmd == "quit":
                    import shutil

                    shutil.rmtree(out_dir, ignore_errors=True)
                    ch.send(bye=True)
                    os._exit(0)  # leave the Trainer loop where it waits
                else:
                    ch.send(error=f"unknown command {cmd!r}")
            parts.clear()
            calls.clear()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            end = time.perf_counter()
            parts["clip_optimizer_zero_grad"] = end - parts.pop("training_step_end")
            ch.send(s=end - self.t, parts=dict(parts), peak_rss_mib=_maxrss_mib(), rss_mib=_rss_mib(), **seen)

    trainer.add_callback(Driver())
    trainer.train()


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, side: str, spec: dict, log: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), OMP_WAIT_POLICY="PASSIVE")
        self.log = log
        self.p = subprocess.Popen([sys.executable, __file__, "_worker", side, json.dumps(spec)], cwd=ROOT, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.side = side

    def ask(self, cmd: str | None = None) -> dict:
        if cmd is not None:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            tail = self.log.read_text()[-4000:]
            raise RuntimeError(f"the {self.side} worker died (exit {self.p.returncode}):\n{tail}")
        return json.loads(line)

    def close(self):
        if self.p.poll() is None:
            try:
                self.ask("quit")
            except (RuntimeError, BrokenPipeError, json.JSONDecodeError):
                pass
            self.p.wait(timeout=60)


# --------------------------------------------------------------------------------------------------
# train: the parent
# --------------------------------------------------------------------------------------------------


def _cpu_seconds(pids) -> tuple[float, float]:
    """(CPU seconds not available to this benchmark: other programs' plus the hypervisor's steal (a VM's
    cores are shared with its host), CPU seconds of this benchmark's processes) so far, from /proc."""
    import resource

    tck = os.sysconf("SC_CLK_TCK")
    try:
        f = open("/proc/stat").readline().split()[1:]
    except OSError:
        return math.nan, 0.0
    busy = sum(int(f[i]) for i in (0, 1, 2, 5, 6, 7)) / tck  # user nice system irq softirq steal
    ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime  # workers already waited for
    for pid in pids:
        try:
            st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            ours += (int(st[11]) + int(st[12])) / tck  # utime, stime of a live worker
        except OSError:
            pass
    return busy, ours


def bench_train(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fx = args.fixture or Path(tmp) / "fixture"
        fx.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        dims = build_fixture(fx, args)
        fixture_s = time.perf_counter() - t
        spec = dict(fixture=str(fx), batch=args.batch, new_tokens=args.new_tokens, repeats=args.repeats,
                    trl_gradient_checkpointing=args.trl_gradient_checkpointing)
        sides = ["jodpo"] + ([] if args.no_trl else ["trl"])
        workers = {s: Worker(s, spec, Path(tmp) / f"{s}.log") for s in sides}
        phases, t = {"fixture": fixture_s}, time.perf_counter()
        pids = [w.p.pid for w in workers.values()]
        cpu, foreign = _cpu_seconds(pids), {}

        def phase(name):
            """Wall seconds of a phase, and the share of the cores others (programs, hypervisor) took meanwhile."""
            nonlocal t, cpu
            now, cpu_now = time.perf_counter(), _cpu_seconds(pids)
            phases[name] = now - t
            other = (cpu_now[0] - cpu[0]) - (cpu_now[1] - cpu[1])
            foreign[name] = max(0.0, other) / (phases[name] * (os.cpu_count() or 1))
            t, cpu = now, cpu_now

        try:
            ready = {s: w.ask() for s, w in workers.items()}
            phase("workers_ready")
            runs = {s: [] for s in sides}
            for i in range(args.warmup + args.steps):
                for s in sides:  # alternate: both see the same machine
                    runs[s].append(workers[s].ask("step"))
            phase("steps")
            rss = {s: w.ask("rss") for s, w in workers.items()}
            phase("rss")
            peaks = {s: [] for s in sides}  # fp32 matmul peak of each library, alternated like the steps
            for _ in range(3):
                for s in sides:
                    peaks[s].append(workers[s].ask("peak")["matmul_peak_gflops"])
            torch_peak = max(peaks["trl"]) if "trl" in peaks else None
            phase("matmul_peak")
            if "trl" in workers:
                workers.pop("trl").close()
            parts = workers["jodpo"].ask("breakdown")
            workers.pop("jodpo").close()
            phase("breakdown")
        finally:
            for w in workers.values():
                w.close()
        # The sampler vs generate on the same model and batch: the first step's prompts, two copies each.
        prompts = json.loads((fx / "prompts.json").read_text())
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(fx / "policy")
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts[:args.batch]]
        P0 = min(len(e) for e in enc)  # equal lengths: no padding in either (the sampler comparison's setting)
        ids = np.asarray([e[-P0:] for e in enc] * 2, np.int32)
        sampler = compare_sampler(fx / "policy", ids, args.new_tokens, args.sample_repeats)
        phase("sampler")
        prompt_lens = np.asarray([len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts])
    parts["matmul_peak_gflops"] = max(peaks["jodpo"])
    result = summarize(args, dims, fixture_s, ready, runs, rss, parts, torch_peak, sampler, prompt_lens)
    result["matmul_peak_runs_gflops"] = peaks
    result["phases_s"] = phases
    result["cores_taken_by_others_share"] = foreign  # > 0.05 in a timed phase: the run was disturbed
    return result


def _step_stats(runs: list, warmup: int, B: int) -> dict:
    timed = runs[warmup:]
    s = [r["s"] for r in timed]
    med = statistics.median(s)
    out = {"median_s": med, "episodes_per_s": B / med, "times_s": s, "warmup_s": [r["s"] for r in runs[:warmup]],
           "completion_tokens": [r["completion_tokens"] for r in timed],
           "completion_width": [r["completion_width"] for r in timed],
           "prompt_width": [r["prompt_width"] for r in timed],
           "peak_rss_mib_after_each_step": [r["peak_rss_mib"] for r in runs],
           "rss_mib_after_each_step": [r["rss_mib"] for r in runs]}
    if "parts" in timed[0]:
        out["parts_median_s"] = {k: statistics.median(r["parts"][k] for r in timed) for k in timed[0]["parts"]}
    return out


def summarize(args, dims, fixture_s, ready, runs, rss, parts, torch_peak, sampler, prompt_lens) -> dict:
    B, T = args.batch, args.new_tokens
    j = _step_stats(runs["jodpo"], args.warmup, B)
    jr = runs["jodpo"][args.warmup:]
    j.update(compile_plus_first_s=runs["jodpo"][0]["s"], donated=all(r["donated"] for r in jr),
             recompiles_after_first=sum(r["compiled"] for r in runs["jodpo"][1:]))
    trl = _step_stats(runs["trl"], args.warmup, B) if "trl" in runs else None
    # The machine's fp32 matmul peak: the best of what the libraries reach here (jax's own XLA dot and
    # torch's MKL), so a slower dot kernel counts against the fraction instead of hiding in the peak.
    peak = max(parts["matmul_peak_gflops"], torch_peak or 0.0)
    P = jr[-1]["prompt_width"]
    # FLOPs of the last timed step's real lengths (the breakdown reruns its inputs).
    p, c = np.asarray(jr[-1]["prompt_lens"]), np.asarray(jr[-1]["completion_lens"])
    fl = step_flops(dims, p, c, P, T)
    pieces = {"sampling": parts["sampling_s"], "reward_scoring": parts["reward_scoring_s"],
              "reference_logprobs": parts["reference_logprobs_s"], "policy_fwd_bwd": parts["policy_fwd_bwd_s"],
              "optimizer": parts["optimizer_s"]}
    breakdown = {k: {"s": v, "useful_gflop": fl[k]["useful"], "executed_gflop": fl[k]["jodpo"],
                     "useful_gflops_per_s": fl[k]["useful"] / v, "executed_gflops_per_s": fl[k]["jodpo"] / v,
                     "useful_frac_of_peak": fl[k]["useful"] / v / peak,
                     "useful_frac_of_jax_peak": fl[k]["useful"] / v / parts["matmul_peak_gflops"]}
                 for k, v in pieces.items()}
    breakdown["sum_of_pieces_s"] = sum(pieces.values())
    breakdown["policy_fwd_only_s"] = parts["policy_fwd_only_s"]
    breakdown["lm_head_fwd_bwd_s"] = parts["lm_head_fwd_bwd_s"]
    breakdown["lm_head_fwd_bwd_gflop"] = 3 * 2 * dims["hidden"] * dims["vocab"] * 2 * B * T / 1e9
    breakdown["first_call_s"] = parts["first_call_s"]
    result = {
        "benchmark": "train",
        "model": f"GPT-NeoX (random), hidden {dims['hidden']}, {dims['layers']} layers, {dims['heads']} heads, "
                 f"vocab {dims['vocab']}, fp32, no gradient checkpointing"
                 + (" (TRL: gradient checkpointing on)" if args.trl_gradient_checkpointing else ""),
        "settings": dict(batch=B, new_tokens=T, prompt_width=P, prompt_len_min=int(prompt_lens.min()),
                         prompt_len_max=int(prompt_lens.max()), prompts=len(prompt_lens), warmup=args.warmup,
                         steps=args.steps, repeats=args.repeats, temperature=TEMPERATURE, beta=TRL_BETA,
                         loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, learning_rate=LR,
                         trl_gradient_checkpointing=args.trl_gradient_checkpointing,
                         eos_token_ids=ready["jodpo"]["eos_token_ids"], fixture_build_s=fixture_s),
        "jodpo": j, "trl": trl, "trl_worker": ready.get("trl"),
        "ratio_time_jodpo_over_trl": j["median_s"] / trl["median_s"] if trl else None,
        "memory": {"jodpo_peak_rss_mib": rss["jodpo"]["peak_rss_mib"],
                   "jodpo_torch_loaded": rss["jodpo"]["torch_loaded"],
                   "trl_peak_rss_mib": rss["trl"]["peak_rss_mib"] if trl else None,
                   "ratio_jodpo_over_trl": rss["jodpo"]["peak_rss_mib"] / rss["trl"]["peak_rss_mib"] if trl else None,
                   "peak_rss_mib_after_loading": {s: w["peak_rss_mib"] for s, w in ready.items()}},
        "breakdown": breakdown,
        "flops_gflop": fl,
        "matmul_peak_gflops": {"jax": parts["matmul_peak_gflops"], "torch": torch_peak, "peak": peak},
        "step_useful_gflops_per_s": {"jodpo": fl["step"]["useful"] / j["median_s"],
                                     "trl": fl["step"]["useful"] / trl["median_s"] if trl else None},
        "sampler": sampler,
    }
    fb = breakdown["policy_fwd_bwd"]["useful_frac_of_peak"]
    result["targets"] = {
        "step_time_at_most_a_third_of_trl": (result["ratio_time_jodpo_over_trl"] <= 1 / 3) if trl else None,
        "fwd_bwd_at_least_half_of_peak": fb >= 0.5,
        "sampler_at_least_2x_generate": sampler["speedup"] >= 2.0,
        "peak_memory_at_most_trl": (result["memory"]["ratio_jodpo_over_trl"] <= 1.0) if trl else None,
    }
    return result


def print_train(r: dict):
    j, t, m = r["jodpo"], r["trl"], r["memory"]
    f = lambda x, fmt="{:.3f}": "-" if x is None else fmt.format(x)
    print(f"\n{r['model']}; batch {r['settings']['batch']} prompts x 2 completions, {r['settings']['new_tokens']} "
          f"new tokens, prompts {r['settings']['prompt_width']} wide; medians of {r['settings']['steps']} steps")
    print(f"{'':28s}{'jodpo':>10s}{'TRL 1.16':>10s}{'jodpo/TRL':>11s}")
    print(f"{'s / step':28s}{j['median_s']:10.3f}{f(t and t['median_s']):>10s}{f(r['ratio_time_jodpo_over_trl']):>11s}")
    print(f"{'episodes (prompts) / s':28s}{j['episodes_per_s']:10.3f}{f(t and t['episodes_per_s']):>10s}")
    print(f"{'peak RSS MiB':28s}{m['jodpo_peak_rss_mib']:10.0f}{f(m['trl_peak_rss_mib'], '{:.0f}'):>10s}"
          f"{f(m['ratio_jodpo_over_trl']):>11s}")
    sg = r["step_useful_gflops_per_s"]
    print(f"{'useful GFLOP/s (whole step)':28s}{sg['jodpo']:10.1f}{f(sg['trl'], '{:.1f}'):>10s}")
    print(f"completion tokens per step: jodpo {j['completion_tokens']}, TRL {t and t['completion_tokens']}")
    pk = r["matmul_peak_gflops"]
    print(f"\nmatmul peak (fp32 2048^3): jax {pk['jax']:.1f} GFLOP/s, torch {f(pk['torch'], '{:.1f}')} GFLOP/s; "
          f"% peak below is of {pk['peak']:.1f}")
    print(f"{'jodpo piece':22s}{'s':>8s}{'useful GF':>11s}{'exec GF':>10s}{'useful GF/s':>13s}{'% peak':>8s}")
    b = r["breakdown"]
    for k in ("sampling", "reward_scoring", "reference_logprobs", "policy_fwd_bwd", "optimizer"):
        x = b[k]
        print(f"{k:22s}{x['s']:8.3f}{x['useful_gflop']:11.1f}{x['executed_gflop']:10.1f}"
              f"{x['useful_gflops_per_s']:13.1f}{100 * x['useful_frac_of_peak']:8.1f}")
    print(f"{'sum of pieces':22s}{b['sum_of_pieces_s']:8.3f}   (fused step {j['median_s']:.3f}; policy fwd only "
          f"{b['policy_fwd_only_s']:.3f}; LM head fwd+bwd {b['lm_head_fwd_bwd_s']:.3f})")
    if t and "parts_median_s" in t:
        print("TRL pieces (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t["parts_median_s"].items()))
    s = r["sampler"]
    print(f"\nsampler ({s['batch']} rows x {s['new_tokens']} tokens): jodpo {s['jodpo_tokens_per_s']:.1f} tok/s, "
          f"HF generate {s['hf_generate_tokens_per_s']:.1f} tok/s, speedup {s['speedup']:.2f}x")
    print("targets: " + ", ".join(f"{k}: {v}" for k, v in r["targets"].items()))
    busy = {k: v for k, v in r.get("cores_taken_by_others_share", {}).items() if v > 0.05 and k != "fixture"}
    if busy:
        taken = ", ".join(f"{k} ({100 * v:.0f}%)" for k, v in busy.items())
        print(f"WARNING: other programs or the hypervisor (steal) took the cores during {taken}: re-run")


def print_sample(result: dict):
    print(f"{'':24s}{'seconds':>10s}{'tokens/s':>12s}")
    print(f"{'jodpo.sample':24s}{result['jodpo_s']:10.3f}{result['jodpo_tokens_per_s']:12.1f}")
    print(f"{'transformers.generate':24s}{result['hf_generate_s']:10.3f}{result['hf_generate_tokens_per_s']:12.1f}")
    print(f"speedup jodpo / HF: {result['speedup']:.2f}x  "
          f"(compile + first call {result['jodpo_compile_plus_first_s']:.1f} s)")


def machine() -> dict:
    import jax

    out = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
           "device": str(jax.devices()[0])}
    try:
        out["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for name in ("torch", "transformers", "trl"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_worker":
        side, spec = sys.argv[2], json.loads(sys.argv[3])
        ch = Channel()
        return {"jodpo": worker_jodpo, "trl": worker_trl}[side](spec, ch)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sample", help="sampler tokens/s vs transformers' generate")
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--new-tokens", type=int, default=53)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--out", type=Path)
    t = sub.add_parser("train", help="jodpo's online DPO step vs TRL's OnlineDPOTrainer step")
    t.add_argument("--batch", type=int, default=8, help="prompts per step (two completions each)")
    t.add_argument("--new-tokens", type=int, default=53)
    t.add_argument("--prompt-len", type=int, default=70, help="longest prompt, tokens (prompts are 6 shorter at most)")
    t.add_argument("--prompts", type=int, default=64, help="prompts in the dataset")
    t.add_argument("--vocab", type=int, default=PYTHIA_70M["vocab_size"])
    t.add_argument("--hidden", type=int, default=PYTHIA_70M["hidden_size"])
    t.add_argument("--layers", type=int, default=PYTHIA_70M["num_hidden_layers"])
    t.add_argument("--heads", type=int, default=PYTHIA_70M["num_attention_heads"])
    t.add_argument("--warmup", type=int, default=2, help="untimed steps per side (compilation, allocator)")
    t.add_argument("--steps", type=int, default=5, help="timed steps per side")
    t.add_argument("--repeats", type=int, default=3, help="timed calls per piece of jodpo's breakdown")
    t.add_argument("--sample-repeats", type=int, default=5, help="timed pairs of the sampler comparison")
    t.add_argument("--no-trl", action="store_true", help="jodpo only")
    t.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL with its own default (gradient checkpointing on, so generate runs without a KV cache); "
                        "jodpo stays without rematerialisation: an out-of-the-box comparison, not a like-for-like one")
    t.add_argument("--fixture", type=Path, help="build (or reuse) the fixture here instead of a temporary dir")
    t.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"sample": bench_sample, "train": bench_train}[args.what](args)
    result["machine"] = machine()
    result["command"] = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (print_sample if args.what == "sample" else print_train)(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Shared by scripts/bench.py and its workers: settings, fixtures, FLOP counting, timing, the sampler comparison."""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
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


# --------------------------------------------------------------------------------------------------
# sample: jodpo.sample vs transformers' generate
# --------------------------------------------------------------------------------------------------


def torch_device():
    """The torch side's device: the GPU where torch sees one (as jax uses its default backend), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare_sampler(path: Path, ids: np.ndarray, T: int, repeats: int, dtype: str = "float32") -> dict:
    """jodpo.sample vs HF generate on ``ids`` (no padding, no EOS: every row makes T tokens), alternated; both
    in ``dtype`` on their default device (jax's backend; torch's GPU if it sees one)."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import jodpo

    model, params = jodpo.load_model(str(path), dtype=dtype)
    dev = torch_device()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(dev).eval()
    B, P = ids.shape
    mask = np.ones_like(ids)
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=TEMPERATURE, pad_token_id=0)
    sample = jax.jit(jodpo.sample, static_argnums=(0, 5))

    def run_jodpo(i):
        out = sample(model, params, ids, mask, jax.random.key(i), cfg)
        assert int(out.mask.sum()) == B * T
        out.tokens.block_until_ready()

    t_ids, t_mask = torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(mask, device=dev)

    def run_hf(i):
        torch.manual_seed(i)
        with torch.no_grad():
            out = hf.generate(input_ids=t_ids, attention_mask=t_mask, do_sample=True, temperature=TEMPERATURE,
                              top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=0,
                              eos_token_id=None, use_cache=True)
        _sync(torch)
        assert out.shape == (B, P + T)

    compile_s = _timed(lambda: run_jodpo(0))
    run_hf(0)  # warm-up
    times = {"jodpo": [], "hf": []}
    for i in range(1, repeats + 1):
        times["jodpo"].append(_timed(lambda: run_jodpo(i)))
        times["hf"].append(_timed(lambda: run_hf(i)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": B, "prompt_len": P, "new_tokens": T, "repeats": repeats, "dtype": dtype,
            "devices": {"jodpo": str(jax.devices()[0]), "hf_generate": str(dev)},
            "jodpo_compile_plus_first_s": compile_s, "jodpo_s": med["jodpo"], "hf_generate_s": med["hf"],
            "jodpo_tokens_per_s": B * T / med["jodpo"], "hf_generate_tokens_per_s": B * T / med["hf"],
            "speedup": med["hf"] / med["jodpo"], "all_times": times}




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
# real: the reward function both sides call (bench_real.py)
# --------------------------------------------------------------------------------------------------


def _text(x) -> str:
    """A prompt or completion as text: chat data's messages give their last message's content."""
    return str(x[-1]["content"]) if isinstance(x, list) else str(x)


def summary_reward(prompts, completions, **_) -> list[float]:
    """A cheap programmatic reward for a one-sentence summary, the same callable on both sides (jodpo's
    ``reward_funcs`` and TRL's): the share of the completion's words that occur in the prompt's passage (grounded),
    minus how far its length is from 20 words, relative to 20 (concise). It costs microseconds; the benchmark is
    about the training step, not the reward."""
    out = []
    for p, c in zip(prompts, completions):
        passage = set(re.findall(r"[a-z0-9']+", _text(p).lower()))
        words = re.findall(r"[a-z0-9']+", _text(c).lower())
        grounded = sum(w in passage for w in words) / max(1, len(words))
        out.append(grounded - abs(len(words) - 20) / 20)
    return out


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
    jodpo's current step executes (each padded prompt [B, P] once, the padded completions [2B, T] attending
    to its keys, dense attention);
    ``trl``: what TRL 1.16 executes (two copies of each prompt, the LM head over prompt positions too).
    p: i32[B] real prompt lengths; c: i32[2B] completion lengths (block layout); P, T: padded widths."""
    B = len(p)
    pp = np.concatenate([p, p])
    tri = lambda n: n * (n + 1) / 2
    # Policy / reference forward: inputs prompt + completion minus its last token, head at c positions.
    n_in = pp + c - 1
    useful = _fwd(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), c.sum())
    jodpo = _fwd(d, B * P + 2 * B * T, B * P * P + 2 * B * T * (P + T), 2 * B * T)
    trl = _fwd(d, 2 * B * (P + T), 2 * B * tri(P + T), 2 * B * (P + T))  # SDPA causal; logits everywhere
    # Reward model: prompt + completion (its value is read at the last token); no LM head.
    rm_useful = _fwd(d, p.sum() + c.sum(), tri(p).sum() + (tri(pp + c) - tri(pp)).sum(), 0)
    rm_jodpo = _fwd(d, B * P + 2 * B * T, B * P * P + 2 * B * T * (P + T), 0)
    rm_trl = _fwd(d, 2 * B * (P + T), 2 * B * (P + T) ** 2, 0)
    # Sampling: prefill, then c - 1 one-token forwards per completion over the KV cache (the last token's
    # forward is skipped). jodpo prefills each prompt once and attends over every cache slot (P + T).
    s_useful = _fwd(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), B + (c - 1).sum())
    steps = int(c.max()) - 1
    s_jodpo = _fwd(d, B * P, B * P * P, B) + _fwd(d, 2 * B * steps, 2 * B * steps * (P + T),
                                                               2 * B * steps)
    s_trl = _fwd(d, 2 * B * P, 2 * B * tri(P), 2 * B) + _fwd(d, 2 * B * steps,
                                                              2 * B * sum(P + t for t in range(1, steps + 1)),
                                                              2 * B * steps)
    g = lambda x: float(x) / 1e9
    out = {
        "sampling": {"useful": g(s_useful), "jodpo": g(s_jodpo), "trl": g(s_trl)},
        "reward_scoring": {"useful": g(rm_useful), "jodpo": g(rm_jodpo), "trl": g(rm_trl)},
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


def peak_size(on_gpu: bool) -> int:
    """The square matmul the peak is measured on: 2048 on a CPU, 8192 on a GPU (where 2048 is too small to fill it)."""
    return 8192 if on_gpu else 2048


def _jax_matmul_peak(dtype: str = "float32", repeats: int = 5, n: int | None = None) -> float:
    import jax

    n = n or peak_size(jax.default_backend() == "gpu")
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / _median_time(lambda: mm(a, b).block_until_ready(), repeats) / 1e9



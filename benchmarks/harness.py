"""The benchmarks' shared harness: settings, timing, the fixture built locally, FLOP counting, and the worker
processes each side runs in. Every benchmark module imports this one; it imports none of them.

jax/jodpo and torch/trl are imported inside functions: the TRL worker must not carry jax, nor the jodpo worker more of
torch than jodpo itself loads."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent / "bench.py"  # the command line every worker process is started through

# --------------------------------------------------------------------------------------------------
# settings: the Pythia-70m shape and the TRL defaults both sides run with
# --------------------------------------------------------------------------------------------------

PYTHIA_70M = dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  intermediate_size=2048, rotary_pct=0.25, max_position_embeddings=2048)
EOS, PAD, UNK = "<|endoftext|>", "<|padding|>", "<|unk|>"  # ids 0, 1, 2 (Pythia: EOS 0, pad 1)
FIXED = ["SUBREDDIT", "TITLE", "POST", "TL", "DR", "r", ":", ";", "/", ".", ","]
TRL_BETA, LR, TEMPERATURE, MISSING_EOS_PENALTY, MAX_LENGTH = 0.1, 5e-7, 0.9, 1.0, 512  # TRL defaults / tldr



def set_environment() -> None:
    """What every benchmark process runs with (bench.py sets it before anything else; its workers inherit it)."""
    # Idle OpenMP threads of torch otherwise spin after each call and steal the cores from whatever runs next
    # (measured here: both jodpo and transformers ran 25-40% slower when alternated with spinning threads).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


# --------------------------------------------------------------------------------------------------
# timing: wall and CPU seconds, memory, the matmul peak, the machine
# --------------------------------------------------------------------------------------------------


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn, repeats: int, first: dict | None = None, name: str | None = None) -> float:
    """The median of ``repeats`` timed calls of ``fn`` after one untimed call (compilation), whose seconds go to
    ``first[name]`` when ``first`` is given."""
    t = timed(fn)
    if first is not None:
        first[name] = t
    return statistics.median(timed(fn) for _ in range(repeats))


def cpu_seconds(pids) -> tuple[float, float]:
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


class Phases:
    """Wall seconds of a benchmark's phases, one after the other, and the share of the machine's cores that others
    (other programs, the hypervisor's steal) took during each: above 5% in a timed phase, the run was disturbed."""

    def __init__(self, pids=(), **seconds: float):
        self.pids, self.seconds, self.foreign = list(pids), dict(seconds), {}
        self._mark = (time.perf_counter(), cpu_seconds(self.pids))

    def end(self, name: str) -> None:
        """The phase ``name`` ends now (it began where the previous one ended, or when this clock was made)."""
        now, cpu = time.perf_counter(), cpu_seconds(self.pids)
        self.seconds[name] = now - self._mark[0]
        other = (cpu[0] - self._mark[1][0]) - (cpu[1] - self._mark[1][1])
        self.foreign[name] = max(0.0, other) / (self.seconds[name] * (os.cpu_count() or 1))
        self._mark = (now, cpu)


def disturbance_warning(shares: dict[str, float], untimed=("fixture", "build")) -> str | None:
    """The line a result prints when others took more than 5% of the cores during a timed phase, else None."""
    busy = {k: v for k, v in shares.items() if v > 0.05 and k not in untimed}
    if not busy:
        return None
    return ("WARNING: other programs or the hypervisor (steal) took the cores during "
            + ", ".join(f"{k} ({100 * v:.0f}%)" for k, v in busy.items()) + ": re-run")


def maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_mib() -> float:
    """Resident memory now (the peak is ``maxrss_mib``)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def torch_device():
    """The torch side's device: the GPU where torch sees one (as jax uses its default backend), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync_torch(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_size(on_gpu: bool) -> int:
    """The square matmul the peak is measured on: 2048 on a CPU, 8192 on a GPU (where 2048 is too small to fill it)."""
    return 8192 if on_gpu else 2048


def jax_matmul_peak(dtype: str = "float32", repeats: int = 5, n: int | None = None) -> float:
    """GFLOP/s of one square matmul in ``dtype`` on jax's default device (the median of ``repeats``)."""
    import jax

    n = n or peak_size(jax.default_backend() == "gpu")
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / median_time(lambda: mm(a, b).block_until_ready(), repeats) / 1e9


def jax_memory_bandwidth(repeats: int = 5) -> float:
    """Bytes/s that jax's default device moves over a large bf16 array (1 GiB on an accelerator, 32 MiB on a CPU): the
    better of one elementwise pass (read and write) and one reduction (read only), the bandwidth a decode step's bound
    is reckoned against."""
    import jax
    import jax.numpy as jnp

    n = 2 ** 29 if jax.default_backend() != "cpu" else 2 ** 24
    x = jnp.ones((n,), jnp.bfloat16)
    add, total = jax.jit(lambda x: x + 1), jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    return max(2 * 2 * n / median_time(lambda: add(x).block_until_ready(), repeats),
               2 * n / median_time(lambda: total(x).block_until_ready(), repeats))


def jax_device_peak_mib(jax) -> float | None:
    """Peak memory on the accelerator (None on the CPU, whose memory is the process's RSS)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats["peak_bytes_in_use"] / 2 ** 20 if stats and "peak_bytes_in_use" in stats else None


def machine() -> dict:
    """What ran the benchmark: the platform, the CPU model, jax's device, the libraries' versions."""
    import platform

    import jax

    out = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
           "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind}
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


# --------------------------------------------------------------------------------------------------
# the fixture (tokenizer, policy, reward model, prompts), built locally: nothing is downloaded
# --------------------------------------------------------------------------------------------------


def build_pythia_70m_shaped(out: Path, seed: int = 0) -> Path:
    """A random GPT-NeoX with Pythia-70m's shapes, saved with transformers (nothing is downloaded)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    GPTNeoXForCausalLM(GPTNeoXConfig(**PYTHIA_70M)).save_pretrained(out)
    return out


def config_models(a, folder: Path):
    """A GPT-NeoX causal LM and reward model of the shape ``a.vocab``, ``a.hidden``, ``a.layers``, ``a.heads`` (a 4x
    MLP), as ``jodpo.models.loading.model_from_dir`` reads them from a ``config.json`` alone: no weights, any size."""
    from transformers import GPTNeoXConfig

    from jodpo.models.loading import model_from_dir

    cfg = dict(PYTHIA_70M, vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
               num_attention_heads=a.heads, intermediate_size=4 * a.hidden, eos_token_id=0, bos_token_id=0,
               pad_token_id=1)
    out = []
    for task, arch in (("causal_lm", "GPTNeoXForCausalLM"), ("reward", "GPTNeoXForSequenceClassification")):
        (folder / task).mkdir(parents=True, exist_ok=True)
        GPTNeoXConfig(**cfg, num_labels=1, architectures=[arch]).to_json_file(folder / task / "config.json")
        out.append(model_from_dir(folder / task, task, "float32"))
    return out


def pseudo_words(n: int) -> list[str]:
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
    names += pseudo_words(vocab - len(names))
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
# FLOPs, counted analytically (GPT-NeoX: q, k, v, o and a 4x MLP per layer)
# --------------------------------------------------------------------------------------------------


def forward_flops(d: dict, tokens: float, pairs: float, head_positions: float) -> float:
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
    useful = forward_flops(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), c.sum())
    jodpo = forward_flops(d, B * P + 2 * B * T, B * P * P + 2 * B * T * (P + T), 2 * B * T)
    trl = forward_flops(d, 2 * B * (P + T), 2 * B * tri(P + T), 2 * B * (P + T))  # SDPA causal; logits everywhere
    # Reward model: prompt + completion (its value is read at the last token); no LM head.
    rm_useful = forward_flops(d, p.sum() + c.sum(), tri(p).sum() + (tri(pp + c) - tri(pp)).sum(), 0)
    rm_jodpo = forward_flops(d, B * P + 2 * B * T, B * P * P + 2 * B * T * (P + T), 0)
    rm_trl = forward_flops(d, 2 * B * (P + T), 2 * B * (P + T) ** 2, 0)
    # Sampling: prefill, then c - 1 one-token forwards per completion over the KV cache (the last token's
    # forward is skipped). jodpo prefills each prompt once and attends over every cache slot (P + T).
    s_useful = forward_flops(d, p.sum() + (c - 1).sum(), tri(p).sum() + (tri(n_in) - tri(pp)).sum(), B + (c - 1).sum())
    steps = int(c.max()) - 1
    s_jodpo = forward_flops(d, B * P, B * P * P, B) + forward_flops(d, 2 * B * steps, 2 * B * steps * (P + T),
                                                               2 * B * steps)
    s_trl = forward_flops(d, 2 * B * P, 2 * B * tri(P), 2 * B) + forward_flops(d, 2 * B * steps,
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
# worker processes: one per side, driven over stdin/stdout, one JSON line per answer
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


class Worker:
    """The parent's handle on one worker process (``bench.py _worker SIDE SPEC``)."""

    def __init__(self, side: str, spec: dict, log: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), OMP_WAIT_POLICY="PASSIVE")
        self.log, self.side = log, side
        self.p = subprocess.Popen([sys.executable, str(BENCH), "_worker", side, json.dumps(spec)], cwd=ROOT, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)

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

"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

  python scripts/bench.py sample [--batch 16] [--new-tokens 53] [--prompt-len 64] [--repeats 5] [--out F.json]

``sample``: jodpo's sampler vs transformers' ``generate`` (KV cache on) on the same random
Pythia-70m-shaped GPT-NeoX (hidden 512, 6 layers, 8 heads, vocab 50304), batch and lengths, fp32 on the
CPU. The two alternate, so both see the same machine; the median of ``--repeats`` runs is reported.
No EOS is set, so every row generates all the new tokens in both.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

# Idle OpenMP threads of torch otherwise spin after each call and steal the cores from whatever runs next
# (measured here: both jodpo and transformers ran 25-40% slower when alternated with spinning threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jodpo  # noqa: E402

PYTHIA_70M = dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  intermediate_size=2048, rotary_pct=0.25, max_position_embeddings=2048)


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


def bench_sample(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build_pythia_70m_shaped(Path(tmp) / "policy")
        model, params = jodpo.load_model(str(path))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    B, P, T = args.batch, args.prompt_len, args.new_tokens
    ids = np.random.default_rng(0).integers(0, 50000, (B, P)).astype(np.int32)
    mask = np.ones_like(ids)
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.9, pad_token_id=0)
    sample = jax.jit(jodpo.sample, static_argnums=(0, 5))

    def run_jodpo(i):
        out = sample(model, params, ids, mask, jax.random.key(i), cfg)
        assert int(out.mask.sum()) == B * T
        out.tokens.block_until_ready()

    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask)

    def run_hf(i):
        torch.manual_seed(i)
        with torch.no_grad():
            out = hf.generate(input_ids=t_ids, attention_mask=t_mask, do_sample=True, temperature=0.9, top_k=0,
                              top_p=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=0, use_cache=True)
        assert out.shape == (B, P + T)

    compile_s = _timed(lambda: run_jodpo(0))
    run_hf(0)  # warm-up
    times = {"jodpo": [], "hf": []}
    for i in range(1, args.repeats + 1):
        times["jodpo"].append(_timed(lambda: run_jodpo(i)))
        times["hf"].append(_timed(lambda: run_hf(i)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "benchmark": "sample", "model": "pythia-70m-shaped GPT-NeoX (random), fp32", "batch": B,
        "prompt_len": P, "new_tokens": T, "repeats": args.repeats,
        "jodpo_compile_plus_first_s": compile_s,
        "jodpo_s": med["jodpo"], "hf_generate_s": med["hf"],
        "jodpo_tokens_per_s": B * T / med["jodpo"], "hf_generate_tokens_per_s": B * T / med["hf"],
        "speedup": med["hf"] / med["jodpo"], "all_times": times,
    }


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "device": str(jax.devices()[0])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sample", help="sampler tokens/s vs transformers' generate")
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--new-tokens", type=int, default=53)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"sample": bench_sample}[args.what](args)
    result["machine"] = machine()
    print(f"{'':24s}{'seconds':>10s}{'tokens/s':>12s}")
    print(f"{'jodpo.sample':24s}{result['jodpo_s']:10.3f}{result['jodpo_tokens_per_s']:12.1f}")
    print(f"{'transformers.generate':24s}{result['hf_generate_s']:10.3f}{result['hf_generate_tokens_per_s']:12.1f}")
    print(f"speedup jodpo / HF: {result['speedup']:.2f}x  (compile + first call {result['jodpo_compile_plus_first_s']:.1f} s)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

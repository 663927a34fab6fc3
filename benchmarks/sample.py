"""``bench.py sample``: jodpo's sampler against transformers' ``generate`` (KV cache on) on the same model, batch and
lengths, alternated so that both see the same machine; also the sampler comparison of ``train`` and ``real``.

No EOS is set, so every row generates all the new tokens on both sides."""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import numpy as np
from harness import TEMPERATURE, build_pythia_70m_shaped, sync_torch, timed, torch_device


def add_parser(sub) -> None:
    s = sub.add_parser("sample", help="sampler tokens/s vs transformers' generate")
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--new-tokens", type=int, default=53)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--out", type=Path)


def bench_sample(args) -> dict:
    """On a random Pythia-70m-shaped GPT-NeoX (hidden 512, 6 layers, 8 heads, vocab 50304) built here."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_pythia_70m_shaped(Path(tmp) / "policy")
        ids = np.random.default_rng(0).integers(0, 50000, (args.batch, args.prompt_len)).astype(np.int32)
        out = compare_sampler(path, ids, args.new_tokens, args.repeats, args.dtype)
    return {"benchmark": "sample", "model": f"pythia-70m-shaped GPT-NeoX (random), {args.dtype}", **out}


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
        sync_torch(torch)
        assert out.shape == (B, P + T)

    compile_s = timed(lambda: run_jodpo(0))
    run_hf(0)  # warm-up
    times = {"jodpo": [], "hf": []}
    for i in range(1, repeats + 1):
        times["jodpo"].append(timed(lambda: run_jodpo(i)))
        times["hf"].append(timed(lambda: run_hf(i)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": B, "prompt_len": P, "new_tokens": T, "repeats": repeats, "dtype": dtype,
            "devices": {"jodpo": str(jax.devices()[0]), "hf_generate": str(dev)},
            "jodpo_compile_plus_first_s": compile_s, "jodpo_s": med["jodpo"], "hf_generate_s": med["hf"],
            "jodpo_tokens_per_s": B * T / med["jodpo"], "hf_generate_tokens_per_s": B * T / med["hf"],
            "speedup": med["hf"] / med["jodpo"], "all_times": times}



def print_sample(result: dict) -> None:
    print(f"{'':24s}{'seconds':>10s}{'tokens/s':>12s}")
    print(f"{'jodpo.sample':24s}{result['jodpo_s']:10.3f}{result['jodpo_tokens_per_s']:12.1f}")
    print(f"{'transformers.generate':24s}{result['hf_generate_s']:10.3f}{result['hf_generate_tokens_per_s']:12.1f}")
    print(f"speedup jodpo / HF: {result['speedup']:.2f}x  "
          f"(compile + first call {result['jodpo_compile_plus_first_s']:.1f} s)")

"""``bench.py train``: jodpo's real online DPO step (``train_step.jit_online_step``: sample two completions per prompt,
score them on device with the reward model, update) vs TRL 1.16's ``OnlineDPOTrainer`` step on one fixture built
here (``harness.build_fixture``: a Pythia-70m-shaped policy and reward model with random weights, a 50304-word
tokenizer saved with both, TL;DR-like prompts of about 70 tokens). Each side runs in its own long-lived worker
process (``workers.py``, so each has its own peak RSS); the parent alternates one jodpo step, one TRL step, ...
Then jodpo's step is timed piece by piece, FLOPs are counted analytically (``harness.step_flops``) against the
matmul peak measured here, and the sampler is compared with ``generate`` on the same model and batch. Shapes are
flags, so the suite runs the same code on a tiny model."""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import (LR, MISSING_EOS_PENALTY, PYTHIA_70M, TEMPERATURE, TRL_BETA, Phases, Worker, build_fixture,
                     disturbance_warning, step_flops)
from sample import compare_sampler


def add_parser(sub) -> None:
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
    t.add_argument("--peak-size", type=int, help="side of the square matmul the peak is measured on (default 2048 "
                                                  "on a CPU, 8192 on a GPU; smaller is quicker and lower)")
    t.add_argument("--no-trl", action="store_true", help="jodpo only")
    t.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL with its own default (gradient checkpointing on, so generate runs without a KV cache); "
                        "jodpo stays without rematerialisation: an out-of-the-box comparison, not a like-for-like one")
    t.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameters and compute of both sides (and of the matmul peak)")
    t.add_argument("--nominal-peak-tflops", type=float,
                   help="the device's nominal dense peak in --dtype (e.g. 989 for an H100/H200 SXM in bf16): adds MFU")
    t.add_argument("--attention", choices=("xla", "cudnn", "splash"), default="xla",
                   help="jodpo's attention kernel (Model.attention; cudnn: NVIDIA GPUs, bf16)")
    t.add_argument("--fixture", type=Path, help="build (or reuse) the fixture here instead of a temporary dir")
    t.add_argument("--out", type=Path)


def bench_train(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fx = args.fixture or Path(tmp) / "fixture"
        fx.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        dims = build_fixture(fx, args)
        fixture_s = time.perf_counter() - t
        spec = dict(fixture=str(fx), batch=args.batch, new_tokens=args.new_tokens, repeats=args.repeats, dtype=args.dtype,
                    peak_size=args.peak_size,
                    trl_gradient_checkpointing=args.trl_gradient_checkpointing, attention=args.attention)
        sides = ["jodpo"] + ([] if args.no_trl else ["trl"])
        workers = {s: Worker(s, spec, Path(tmp) / f"{s}.log") for s in sides}
        clock = Phases([w.p.pid for w in workers.values()], fixture=fixture_s)

        try:
            ready = {s: w.ask() for s, w in workers.items()}
            clock.end("workers_ready")
            runs = {s: [] for s in sides}
            for i in range(args.warmup + args.steps):
                for s in sides:  # alternate: both see the same machine
                    runs[s].append(workers[s].ask("step"))
            clock.end("steps")
            rss = {s: w.ask("rss") for s, w in workers.items()}
            clock.end("rss")
            peaks = {s: [] for s in sides}  # matmul peak of each library in --dtype, alternated like the steps
            for _ in range(3):
                for s in sides:
                    peaks[s].append(workers[s].ask("peak")["matmul_peak_gflops"])
            torch_peak = max(peaks["trl"]) if "trl" in peaks else None
            clock.end("matmul_peak")
            if "trl" in workers:
                workers.pop("trl").close()
            parts = workers["jodpo"].ask("breakdown")
            workers.pop("jodpo").close()
            clock.end("breakdown")
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
        sampler = compare_sampler(fx / "policy", ids, args.new_tokens, args.sample_repeats, args.dtype)
        clock.end("sampler")
        prompt_lens = np.asarray([len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts])
    parts["matmul_peak_gflops"] = max(peaks["jodpo"])
    result = summarize(args, dims, fixture_s, ready, runs, rss, parts, torch_peak, sampler, prompt_lens)
    result["matmul_peak_runs_gflops"] = peaks
    result["phases_s"] = clock.seconds
    result["cores_taken_by_others_share"] = clock.foreign  # > 0.05 in a timed phase: the run was disturbed
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
    # The machine's matmul peak in --dtype: the best of what the libraries reach here (jax's own XLA dot and
    # torch's MKL or cuBLAS), so a slower dot kernel counts against the fraction instead of hiding in the peak.
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
                     "useful_frac_of_jax_peak": fl[k]["useful"] / v / parts["matmul_peak_gflops"],
                     # MFU: against the device's nominal dense peak, when --nominal-peak-tflops gives it
                     "mfu_nominal": fl[k]["useful"] / v / (1e3 * args.nominal_peak_tflops)
                     if args.nominal_peak_tflops else None}
                 for k, v in pieces.items()}
    breakdown["sum_of_pieces_s"] = sum(pieces.values())
    breakdown["policy_fwd_only_s"] = parts["policy_fwd_only_s"]
    breakdown["lm_head_fwd_bwd_s"] = parts["lm_head_fwd_bwd_s"]
    breakdown["lm_head_fwd_bwd_gflop"] = 3 * 2 * dims["hidden"] * dims["vocab"] * 2 * B * T / 1e9
    breakdown["first_call_s"] = parts["first_call_s"]
    breakdown["prompt_rows"] = parts["prompt_rows"]  # B: the pieces run each prompt once, as the step does
    result = {
        "benchmark": "train",
        "model": f"GPT-NeoX (random), hidden {dims['hidden']}, {dims['layers']} layers, {dims['heads']} heads, "
                 f"vocab {dims['vocab']}, {args.dtype}, no gradient checkpointing"
                 + (" (TRL: gradient checkpointing on)" if args.trl_gradient_checkpointing else ""),
        "settings": dict(batch=B, new_tokens=T, prompt_width=P, prompt_len_min=int(prompt_lens.min()),
                         prompt_len_max=int(prompt_lens.max()), prompts=len(prompt_lens), warmup=args.warmup,
                         steps=args.steps, repeats=args.repeats, temperature=TEMPERATURE, beta=TRL_BETA,
                         loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, learning_rate=LR,
                         trl_gradient_checkpointing=args.trl_gradient_checkpointing, dtype=args.dtype,
                         attention=args.attention, nominal_peak_tflops=args.nominal_peak_tflops,
                         peak_size=args.peak_size,
                         eos_token_ids=ready["jodpo"]["eos_token_ids"], fixture_build_s=fixture_s),
        "jodpo": j, "trl": trl, "trl_worker": ready.get("trl"),
        "ratio_time_jodpo_over_trl": j["median_s"] / trl["median_s"] if trl else None,
        "memory": {"jodpo_peak_rss_mib": rss["jodpo"]["peak_rss_mib"],
                   "jodpo_torch_loaded": rss["jodpo"]["torch_loaded"],
                   "devices": {s: w["device"] for s, w in rss.items()},
                   "device_peak_mib": {s: w["device_peak_mib"] for s, w in rss.items()},  # None on a CPU
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
    dev = r["memory"]["devices"]
    print(f"\ndevices: {', '.join(f'{k} {v}' for k, v in dev.items())}; accelerator peak MiB: "
          + ", ".join(f"{k} {f(v, '{:.0f}')}" for k, v in r["memory"]["device_peak_mib"].items()))
    print(f"matmul peak ({r['settings']['dtype']}): jax {pk['jax']:.1f} GFLOP/s, torch {f(pk['torch'], '{:.1f}')} "
          f"GFLOP/s; % peak below is of {pk['peak']:.1f}")
    print(f"{'jodpo piece':22s}{'s':>8s}{'useful GF':>11s}{'exec GF':>10s}{'useful GF/s':>13s}{'% peak':>8s}")
    b = r["breakdown"]
    for k in ("sampling", "reward_scoring", "reference_logprobs", "policy_fwd_bwd", "optimizer"):
        x = b[k]
        print(f"{k:22s}{x['s']:8.3f}{x['useful_gflop']:11.1f}{x['executed_gflop']:10.1f}"
              f"{x['useful_gflops_per_s']:13.1f}{100 * x['useful_frac_of_peak']:8.1f}"
              + (f"   MFU {100 * x['mfu_nominal']:.1f}% of {r['settings']['nominal_peak_tflops']} TFLOP/s"
                 if x["mfu_nominal"] is not None else ""))
    print(f"{'sum of pieces':22s}{b['sum_of_pieces_s']:8.3f}   (fused step {j['median_s']:.3f}; policy fwd only "
          f"{b['policy_fwd_only_s']:.3f}; LM head fwd+bwd {b['lm_head_fwd_bwd_s']:.3f})")
    if t and "parts_median_s" in t:
        print("TRL pieces (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t["parts_median_s"].items()))
    s = r["sampler"]
    print(f"\nsampler ({s['batch']} rows x {s['new_tokens']} tokens): jodpo {s['jodpo_tokens_per_s']:.1f} tok/s, "
          f"HF generate {s['hf_generate_tokens_per_s']:.1f} tok/s, speedup {s['speedup']:.2f}x")
    print("targets: " + ", ".join(f"{k}: {v}" for k, v in r["targets"].items()))
    if warning := disturbance_warning(r["cores_taken_by_others_share"]):
        print(warning)

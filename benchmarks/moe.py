"""``bench.py moe``: one mixture-of-experts layer (router, top-k, experts: ``jodpo.models.moe.block``) at the layer
shapes of OLMoE-1B-7B (hidden 2048, 64 experts of 1024, 8 a token) and Qwen3-30B-A3B (hidden 2048, 128 experts of
768, 8 a token, renormalised), forward and backward over ``--tokens`` tokens, alternated in one run on the same
weights and inputs:
  tiles         jodpo's dropless experts as they run on a CPU: tokens sorted by expert, a scan over tiles of one
                expert's rows (``grouped_tiles``)
  ragged_dot    the same through ``jax.lax.ragged_dot`` (GPUs' and TPUs' grouped matmuls; jax's CPU version multiplies
                every row by every expert's weights, holding them all: only up to ``--ragged-max-tokens``, the
                decode step's by default)
  dense         the one-hot reference: every token through every expert (``dense_experts``)
  transformers  the family's own sparse block (OlmoeSparseMoeBlock, Qwen3MoeSparseMoeBlock) under torch autograd, with
                the experts implementation transformers picks by default (recorded)
and a decode step (``--decode-tokens`` tokens, one per sequence, forward only): the tiles against the dense reference
and transformers, with how many experts' weights the tiles read (the experts the tokens chose; the dense reference
reads every expert's). Beside the training row, one expert's gate product at a tile's rows (``[t, hidden] x [hidden,
width]``) through XLA's dot and torch's ``mm``, alternated, the fastest of 20 each: the product the tiles repeat, and
where their time against transformers' goes. Medians of ``--repeats`` after one untimed call each; the loss is a
fixed random weighting of the outputs, so every weight and the input have a gradient."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from harness import Phases, disturbance_warning, timed

SHAPES = {"olmoe-1b-7b": dict(hidden=2048, experts=64, width=1024, top_k=8, norm=False, model_type="olmoe"),
          "qwen3-30b-a3b": dict(hidden=2048, experts=128, width=768, top_k=8, norm=True, model_type="qwen3_moe"),
          "tiny": dict(hidden=64, experts=6, width=32, top_k=2, norm=True, model_type="qwen3_moe")}  # the tests'
DEFAULT_SHAPES = ["olmoe-1b-7b", "qwen3-30b-a3b"]


def add_parser(sub) -> None:
    s = sub.add_parser("moe", help="one MoE layer's forward+backward: tiles, ragged_dot, dense, transformers")
    s.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--decode-tokens", type=int, default=8)
    s.add_argument("--ragged-max-tokens", type=int, default=64,
                   help="time ragged_dot only up to this many tokens (jax's CPU version holds [experts, rows, hidden])")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="jodpo's compute dtype (the weights stay float32, as a run's); transformers' stays float32")
    s.add_argument("--out", type=Path)


def _model(shape: dict):
    from jodpo import Model
    from jodpo.models.model import MoE, Norms, Rope

    D = shape["hidden"]
    moe = MoE(num_experts=shape["experts"], top_k=shape["top_k"], expert_dim=shape["width"],
              norm_topk_prob=shape["norm"])
    return Model(family=shape["model_type"], task="causal_lm", vocab_size=8, hidden_size=D, num_layers=1,
                 num_heads=16, num_kv_heads=16, head_dim=D // 16, mlp=None, norms=Norms("rmsnorm", 1e-6),
                 qkv_bias=False, out_bias=False, parallel_residual=False, rope=Rope(2, (1.0,)), tie_embeddings=False,
                 moe=moe)


def _weights(shape: dict, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    D, E, F = shape["hidden"], shape["experts"], shape["width"]
    w = lambda *s: (rng.standard_normal(s, np.float32) * 0.02)  # noqa: E731
    return {"router": w(D, E) * 10, "gate": w(E, D, F), "up": w(E, D, F), "down": w(E, F, D)}


def _torch_block(shape: dict, p: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(shape["model_type"], vocab_size=8, hidden_size=shape["hidden"], num_hidden_layers=1,
                               num_attention_heads=16, num_key_value_heads=16, num_experts=shape["experts"],
                               num_experts_per_tok=shape["top_k"], norm_topk_prob=shape["norm"],
                               intermediate_size=shape["width"], moe_intermediate_size=shape["width"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    block = model.model.layers[0].mlp.to_empty(device="cpu")
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor(p["router"].T))
        block.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([p["gate"], p["up"]], -1).transpose(0, 2, 1)))
        block.experts.down_proj.copy_(torch.tensor(p["down"].transpose(0, 2, 1)))
    return block, model.config._experts_implementation


def _expert_product(rows: int, hidden: int, width: int, repeats: int = 20) -> dict:
    """One ``[rows, hidden] x [hidden, width]`` float32 product, XLA's (at "highest", a run's float32 precision) and
    torch's, alternated: the fastest of ``repeats`` each, in ms, and each one's GFLOP/s."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((rows, hidden), np.float32), rng.standard_normal((hidden, width), np.float32)
    xj, wj, xt, wt = jnp.asarray(x), jnp.asarray(w), torch.tensor(x), torch.tensor(w)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, precision="highest"))
    sides = {"xla": lambda: jax.block_until_ready(dot(xj, wj)), "torch": lambda: torch.mm(xt, wt)}
    times = {k: [] for k in sides}
    for run in sides.values():
        run()
    for _ in range(repeats):
        for k, run in sides.items():
            times[k].append(timed(run))
    best = {k: min(v) for k, v in times.items()}
    return {"rows": rows, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
            **{f"{k}_gflops": 2 * rows * hidden * width / v / 1e9 for k, v in best.items()},
            "ratio_torch_over_xla": best["torch"] / best["xla"]}


def bench_moe(args) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import torch

    from jodpo.models import moe

    rows, clock = [], Phases()
    for name in args.shapes:
        shape = SHAPES[name]
        model, p = _model(shape).replace(dtype=getattr(args, "dtype", "float32")), _weights(shape)
        block, implementation = _torch_block(shape, p)
        pj = {k: jnp.asarray(v) for k, v in p.items()}
        experts = {"tiles": functools.partial(moe.sorted_experts, grouped=moe.grouped_tiles),
                   "ragged_dot": functools.partial(moe.sorted_experts, grouped=moe.grouped_ragged),
                   "dense": moe.dense_experts}

        def jax_step(kind, train):
            def loss(p, x, w):
                y, _ = moe.block(model, p, x[None], experts[kind])
                return jnp.sum(y[0] * w)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)) if train else loss)

        def torch_step(x, w, train):
            xt = torch.tensor(x, requires_grad=train)
            if not train:
                with torch.no_grad():
                    return float((block(xt[None])[0] * torch.tensor(w)).sum())
            block.zero_grad()
            loss = (block(xt[None])[0] * torch.tensor(w)).sum()
            loss.backward()
            return float(loss.detach())

        for phase, T, train in (("train", args.tokens, True), ("decode", args.decode_tokens, False)):
            rng = np.random.default_rng(1)
            x = rng.standard_normal((T, shape["hidden"]), np.float32)
            w = rng.standard_normal((T, shape["hidden"]), np.float32)
            xj, wj = jnp.asarray(x, model.dtype), jnp.asarray(w, model.dtype)
            kinds = ["tiles", "dense"] + (["ragged_dot"] if T <= args.ragged_max_tokens else [])
            fns = {k: jax_step(k, train) for k in kinds}
            sides = {k: (lambda f=f: jax.block_until_ready(f(pj, xj, wj))) for k, f in fns.items()}
            sides["transformers"] = lambda: torch_step(x, w, train)
            first = {k: timed(run) for k, run in sides.items()}
            clock.end(f"build {name} {phase}")
            times = {k: [] for k in sides}
            for _ in range(args.repeats):
                for k, run in sides.items():
                    times[k].append(timed(run))
            clock.end(f"{name} {phase}")
            med = {k: statistics.median(v) for k, v in times.items()}
            value = fns["tiles"](pj, xj, wj)
            ours = float(value[0] if train else value)
            row = {"shape": name, "phase": phase, "tokens": T, "median_s": med, "all_times_s": times,
                   "first_call_s": first,
                   "ratio_transformers_over_tiles": med["transformers"] / med["tiles"],
                   "ratio_dense_over_tiles": med["dense"] / med["tiles"],
                   "loss_relative_difference_vs_transformers": abs(ours - torch_step(x, w, False)) / abs(ours)}
            if "ragged_dot" in med:
                row["ratio_ragged_dot_over_tiles"] = med["ragged_dot"] / med["tiles"]
            if train:
                row["expert_product"] = _expert_product(moe.cpu_tile(T * shape["top_k"], shape["experts"]),
                                                        shape["hidden"], shape["width"])
            if not train:  # the experts whose weights the tiles read: those the tokens chose
                _, _, chosen = moe.route(model, pj["router"], xj)
                counts = np.bincount(np.asarray(chosen).ravel(), minlength=shape["experts"])
                t = moe.cpu_tile(int(counts.sum()), shape["experts"])
                reads = int(np.sum(-(-counts // t)))  # a tile reads its expert's weights: one per tile run
                per_expert = 3 * shape["hidden"] * shape["width"] * 4
                row |= {"experts_read": int(np.sum(counts > 0)), "experts": shape["experts"], "tile_rows": t,
                        "expert_weight_reads": reads, "weight_bytes_read": reads * per_expert,
                        "weight_bytes_dense": shape["experts"] * per_expert}
            rows.append(row)
        rows[-1]["transformers_experts_implementation"] = rows[-2]["transformers_experts_implementation"] = \
            implementation
    return {"benchmark": "moe", "repeats": args.repeats, "device": str(jax.devices()[0]), "dtype": model.dtype,
            "torch_threads": torch.get_num_threads(), "rows": rows, "cores_taken_by_others_share": clock.foreign}


def print_moe(result: dict) -> None:
    print(f"one MoE layer (router + experts), {result.get('dtype', 'float32')}, median of {result['repeats']} (s); "
          f"ratios: x / tiles")
    print(f"{'shape':>14s}{'phase':>8s}{'T':>6s}{'tiles':>9s}{'ragged':>9s}{'dense':>9s}{'transf.':>9s}"
          f"{'transf./t':>11s}{'dense/t':>9s}{'ragged/t':>10s}          experts read  transformers' experts")
    for r in result["rows"]:
        m = r["median_s"]
        read = f"{r['experts_read']}/{r['experts']} ({r['expert_weight_reads']} reads)" if "experts_read" in r else ""
        ragged = m.get("ragged_dot", float("nan"))
        print(f"{r['shape']:>14s}{r['phase']:>8s}{r['tokens']:6d}{m['tiles']:9.3f}{ragged:9.3f}"
              f"{m['dense']:9.3f}{m['transformers']:9.3f}{r['ratio_transformers_over_tiles']:10.2f}x"
              f"{r['ratio_dense_over_tiles']:8.2f}x{r.get('ratio_ragged_dot_over_tiles', float('nan')):9.2f}x"
              f"  {read:>20s}  {r['transformers_experts_implementation']}")
    for r in result["rows"]:
        if g := r.get("expert_product"):
            print(f"{r['shape']:>14s}: one expert's product at {g['rows']} rows (a tile): XLA {g['xla_ms']:.2f} ms "
                  f"({g['xla_gflops']:.0f} GFLOP/s), torch {g['torch_ms']:.2f} ms ({g['torch_gflops']:.0f} GFLOP/s): "
                  f"torch / XLA {g['ratio_torch_over_xla']:.2f}x")
    shares = result["cores_taken_by_others_share"]
    if warning := disturbance_warning({k: v for k, v in shares.items() if not k.startswith("build")}):
        print(warning)

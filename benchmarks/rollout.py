"""``bench.py rollout``: the sampler over a queue of prompts with a long-tailed mix of completion lengths, a fixed batch
of S prompts at a time (each batch decoding until its longest completion ends) against refill (``SamplingConfig.slots``
= S: the rows that ended take the next prompts between decode chunks), at the same rows in flight, alternated.

The completions' lengths come from the EOS ids: a random model (weights small enough that its next-token distribution is
close to uniform) ends a completion with probability about ``--eos-share`` a token, so the lengths are about geometric:
most completions end early, a few run to ``--new-tokens``, and a fixed batch of many rows almost always holds one that
does. Both ways sample the same completions (every completion draws from its own keys, and refill prefills the prompts
in the same batches of S): the benchmark checks that they are token for token the same, then reports real tokens per
second (EOS included, the prefills' token 0 too) and
``sampling.slot_utilization`` (real decoded tokens over the row-steps run)."""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import numpy as np
from harness import timed


def add_parser(sub) -> None:
    s = sub.add_parser("rollout", help="a fixed batch against refill between chunks, long-tailed completion lengths")
    s.add_argument("--prompts", type=int, default=64, help="the queue")
    s.add_argument("--slots", type=int, default=16, help="prompts in flight (each with --samples completions)")
    s.add_argument("--samples", type=int, default=2)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--eos-share", type=float, default=1 / 40, help="about the chance a token ends its completion")
    s.add_argument("--chunk", type=int, default=8)
    s.add_argument("--hidden", type=int, default=256)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--vocab", type=int, default=8192)
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--out", type=Path)


def _model(a):
    import jax

    from jodpo.models import decoder
    from jodpo.models import params as mparams

    head = a.hidden // a.heads
    model = decoder.Model(family="llama", task="causal_lm", vocab_size=a.vocab, hidden_size=a.hidden,
                          num_layers=a.layers, num_heads=a.heads, num_kv_heads=max(1, a.heads // 2), head_dim=head,
                          mlp=decoder.MLP(4 * a.hidden, "silu"), norms=decoder.Norms("rmsnorm", 1e-6), qkv_bias=False,
                          out_bias=False, parallel_residual=False,
                          rope=decoder.Rope(head, tuple(10000.0 ** (-np.arange(0, head, 2) / head))),
                          tie_embeddings=False, dtype=a.dtype)
    return model, mparams.init_params(model, jax.random.key(0), std=0.02)


def bench_rollout(a) -> dict:
    import jax

    import jodpo
    from jodpo import sampling

    model, params = _model(a)
    Q, S, n, P, T = a.prompts, a.slots, a.samples, a.prompt_len, a.new_tokens
    if Q % S:
        raise SystemExit(f"--prompts {Q} must be a multiple of --slots {S} (the fixed batches)")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, a.vocab, (Q, P)).astype(np.int32)
    mask = np.ones_like(ids)
    for i, k in enumerate(rng.integers(P // 2, P + 1, Q)):  # left-padded prompts of several lengths
        mask[i, :P - k] = 0
    eos = tuple(range(0, a.vocab, max(1, round(1 / a.eos_share))))
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=1.0, eos_token_ids=eos, chunk=a.chunk)
    refill_cfg = dataclasses.replace(cfg, slots=S)
    sample = jax.jit(jodpo.sample, static_argnums=(0, 5, 6))
    key = jax.random.key(7)

    def fixed():  # S prompts at a time, each batch drawing as its prompts' places in the queue do
        outs = [sample(model, params, ids[b * S:(b + 1) * S], mask[b * S:(b + 1) * S], key, cfg, n, b * S)
                for b in range(Q // S)]
        return [jax.block_until_ready(o) for o in outs]

    def refill():
        return jax.block_until_ready(sample(model, params, ids, mask, key, refill_cfg, n))

    compile_s = {"fixed": timed(fixed), "refill": timed(refill)}
    got = refill()
    parts = fixed()
    want = {f: np.concatenate([np.asarray(getattr(o, f)).reshape(n, S, T) for o in parts], 1).reshape(n * Q, T)
            for f in ("tokens", "mask")}
    for f in ("tokens", "mask"):  # the same completions (the prompts prefilled in the same batches)
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), want[f])
    times = {"fixed": [], "refill": []}
    for _ in range(a.repeats):
        times["fixed"].append(timed(fixed))
        times["refill"].append(timed(refill))
    med = {k: statistics.median(v) for k, v in times.items()}
    lengths = want["mask"].sum(1)
    tokens = int(lengths.sum())
    used = {"fixed": float(np.mean([sampling.slot_utilization(o, n * S) for o in parts])),
            "refill": float(sampling.slot_utilization(got, n * S))}
    return {"benchmark": "rollout", "model": f"llama, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab} (random)",
            "dtype": a.dtype, "device": str(jax.devices()[0]), "prompts": Q, "slots": S, "samples": n,
            "prompt_len": P, "new_tokens": T, "chunk": a.chunk, "repeats": a.repeats,
            "mean_length": float(lengths.mean()), "median_length": float(np.median(lengths)),
            "at_budget": float((lengths == T).mean()), "real_tokens": tokens, "compile_plus_first_s": compile_s,
            "seconds": med, "tokens_per_s": {k: tokens / v for k, v in med.items()}, "slot_utilization": used,
            "decode_steps": {"fixed": int(sum(int(o.decode_steps[0]) for o in parts)),
                             "refill": int(got.decode_steps[0])},
            "speedup": med["fixed"] / med["refill"], "all_times": times}


def print_rollout(r: dict) -> None:
    print(f"{r['model']}, {r['dtype']}, {r['device']}: {r['prompts']} prompts x {r['samples']} completions, "
          f"{r['slots']} prompts in flight, budget {r['new_tokens']} (chunks of {r['chunk']})")
    print(f"completion lengths: mean {r['mean_length']:.1f}, median {r['median_length']:.0f}, "
          f"{100 * r['at_budget']:.1f}% at the budget; {r['real_tokens']} real tokens, the same both ways")
    print(f"{'':8} {'s (median)':>11} {'tokens/s':>9} {'decode steps':>13} {'slot use':>9}")
    for k in ("fixed", "refill"):
        print(f"{k:8} {r['seconds'][k]:11.2f} {r['tokens_per_s'][k]:9.0f} {r['decode_steps'][k]:13d} "
              f"{r['slot_utilization'][k]:9.2f}")
    print(f"refill / fixed real tokens/s: {r['speedup']:.2f}x")

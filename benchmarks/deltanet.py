"""``bench.py deltanet``: one Gated DeltaNet core (the gated delta rule, ``jodpo.models.delta_rule``) at Qwen3.5-0.8B's
sizes (16 key and 16 value heads of 128, batch 1), forward and backward, three ways in one run: jodpo's
``chunked_delta_rule`` (WY/UT chunks, the backward from a state saved a chunk) alternated with transformers'
reference ``torch_chunk_gated_delta_rule`` (Qwen3-Next's, what Qwen3.5 runs without flash-linear-attention) under
torch autograd, then jax's autodiff of the plain token-by-token recurrence (``recurrent_delta_rule``, a ``lax.scan``)
on its own; the median of ``--repeats`` after one untimed call each. Next to the times, XLA's temporaries
(``memory_analysis()`` of the compiled gradient) of the recomputing backward, of autodiff through the recurrence and
of autodiff through the same chunked scan (``chunked_delta_rule_autodiff``), and how far jodpo's outputs and
gradients are from transformers'.

The loss is a fixed random weighting of every output and of the final state, so every input has a gradient. The
three read the same float32 inputs (q and k L2-normalised, g <= 0, beta in (0, 1), a random initial state);
transformers gets q unscaled, as it scales q by Dk**-0.5 itself."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from harness import Phases, disturbance_warning, timed

MiB = 2 ** 20


def add_parser(sub) -> None:
    s = sub.add_parser("deltanet", help="the gated delta rule's forward+backward: chunked, recurrence, transformers")
    s.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    s.add_argument("--chunk", type=int, default=64)
    s.add_argument("--heads", type=int, default=16, help="key heads (the value heads: --value-heads)")
    s.add_argument("--value-heads", type=int, default=16)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--no-recurrent-above", type=int, default=4096,
                   help="time the recurrence's autodiff only up to this length (its residuals grow as T states)")
    s.add_argument("--out", type=Path)


def _inputs(B, T, Hk, Hv, D, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = l2(rng.normal(size=(B, T, Hk, D))), l2(rng.normal(size=(B, T, Hk, D)))
    v = rng.normal(size=(B, T, Hv, D))
    g = np.log(rng.uniform(0.9, 1.0, (B, T, Hv)))  # decays near 1, as a trained layer's mostly are
    beta = rng.uniform(0.0, 1.0, (B, T, Hv))
    S = rng.normal(size=(B, Hv, D, D)) * 0.1
    w_out, w_S = rng.normal(size=(B, T, Hv, D)), rng.normal(size=(B, Hv, D, D))
    return [x.astype(np.float32) for x in (q * D ** -0.5, k, v, g, beta, S, w_out, w_S)]


def bench_deltanet(args) -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from jodpo.models.delta_rule import chunked_delta_rule, chunked_delta_rule_autodiff, recurrent_delta_rule

    B, Hk, Hv, D, C = args.batch, args.heads, args.value_heads, args.head_dim, args.chunk

    def jax_grad(f):
        def loss(q, k, v, g, beta, S, w_out, w_S):
            out, S1 = f(q, k, v, g, beta, S)
            return (out * w_out).sum() + (S1 * w_S).sum()
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))

    grads = {"chunked": jax_grad(lambda *a: chunked_delta_rule(*a, chunk=C)),
             "recurrent_autodiff": jax_grad(recurrent_delta_rule),
             "chunked_autodiff": jax_grad(lambda *a: chunked_delta_rule_autodiff(*a, chunk=C))}

    def torch_grad(x):
        t = [torch.tensor(a, requires_grad=i < 6) for i, a in enumerate(x)]
        q = t[0] * D ** 0.5  # transformers scales q itself
        out, S1 = torch_chunk_gated_delta_rule(q, *t[1:5], chunk_size=C, initial_state=t[5], output_final_state=True,
                                               use_qk_l2norm_in_kernel=False)
        loss = (out * t[6]).sum() + (S1 * t[7]).sum()
        loss.backward()
        return loss.item(), [a.grad.numpy() for a in t[:6]]

    rows, clock = [], Phases()
    for T in args.lengths:
        x = _inputs(B, T, Hk, Hv, D)
        sds = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in x]
        memory = {}
        for name, f in grads.items():
            m = f.lower(*sds).compile().memory_analysis()
            memory[name] = m.temp_size_in_bytes / MiB
        xj = [jnp.asarray(a) for a in x]
        sides = {"chunked": lambda: jax.block_until_ready(grads["chunked"](*xj)), "transformers": lambda: torch_grad(x)}
        alone = {}  # the recurrence after the pair, not between: its GBs of residuals, allocated and freed, slowed
        if T <= args.no_recurrent_above:  # the chunked call after it by two thirds (0.18 -> 0.31 s at T = 512)
            alone["recurrent_autodiff"] = lambda: jax.block_until_ready(grads["recurrent_autodiff"](*xj))
        first = {name: timed(run) for name, run in {**sides, **alone}.items()}  # compiles (jax), warms up (torch)
        clock.end(f"build T={T}")
        times = {name: [] for name in {**sides, **alone}}
        for _ in range(args.repeats):
            for name, run in sides.items():
                times[name].append(timed(run))
        clock.end(f"T={T}")
        for name, run in alone.items():
            times[name] = [timed(run) for _ in range(args.repeats)]
        clock.end(f"T={T} recurrence")
        med = {name: statistics.median(v) for name, v in times.items()}
        (loss_j, grads_j), (loss_t, grads_t) = grads["chunked"](*xj), torch_grad(x)
        diff = max(float(np.abs(np.asarray(a) - b).max() / np.abs(b).max()) for a, b in zip(grads_j, grads_t))
        rows.append({"T": T, "median_s": med, "all_times_s": times, "first_call_s": first,
                     "ratio_transformers_over_chunked": med["transformers"] / med["chunked"],
                     "ratio_recurrent_over_chunked": med.get("recurrent_autodiff", float("nan")) / med["chunked"],
                     "temp_mib": memory,
                     "ratio_temp_recurrent_autodiff_over_chunked": memory["recurrent_autodiff"] / memory["chunked"],
                     "ratio_temp_chunked_autodiff_over_chunked": memory["chunked_autodiff"] / memory["chunked"],
                     "loss_relative_difference_vs_transformers": abs(float(loss_j) - loss_t) / abs(loss_t),
                     "grad_max_relative_difference_vs_transformers": diff})
    return {"benchmark": "deltanet", "batch": B, "key_heads": Hk, "value_heads": Hv, "head_dim": D, "chunk": C,
            "repeats": args.repeats, "device": str(jax.devices()[0]), "torch_threads": torch.get_num_threads(),
            "rows": rows, "cores_taken_by_others_share": clock.foreign}  # > 0.05 in a timed phase: disturbed


def print_deltanet(result: dict) -> None:
    r0 = result
    print(f"gated delta rule, forward+backward: B={r0['batch']} Hk={r0['key_heads']} Hv={r0['value_heads']} "
          f"D={r0['head_dim']} chunk={r0['chunk']}, median of {r0['repeats']} (s)")
    print(f"{'T':>6s}{'chunked':>10s}{'recurrent':>11s}{'transf.':>10s}{'transf./ch':>12s}{'rec./ch':>9s}"
          f"  | temp MiB: {'chunked':>8s}{'rec. AD':>9s}{'chunk AD':>9s}  | grad diff")
    for r in result["rows"]:
        m, t = r["median_s"], r["temp_mib"]
        print(f"{r['T']:6d}{m['chunked']:10.3f}{m.get('recurrent_autodiff', float('nan')):11.3f}"
              f"{m['transformers']:10.3f}{r['ratio_transformers_over_chunked']:11.2f}x"
              f"{r['ratio_recurrent_over_chunked']:8.2f}x  |           {t['chunked']:8.1f}"
              f"{t['recurrent_autodiff']:9.1f}{t['chunked_autodiff']:9.1f}"
              f"  | {r['grad_max_relative_difference_vs_transformers']:.1e}")
    shares = result["cores_taken_by_others_share"]
    if warning := disturbance_warning({k: v for k, v in shares.items() if not k.startswith("build")}):
        print(warning)
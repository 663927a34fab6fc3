"""``bench.py traffic``: every byte of a decode step, from the compiled program, against the ideal; and the fused step's
FLOPs against the algorithm's count. Nothing is run: XLA's ``cost_analysis()`` of programs compiled for jax's default
backend (the CPU here), or ahead of time for a TPU chip with libtpu (``--tpu v5e:1x1``, as ``memory --tpu``).

- **decode step** (``jodpo.sampling.decode_step``: the model on one token a row after a per-layer cache, the sampler's
  weights in the compute dtype): its bytes accessed against the ideal, which reads every weight once (the input
  embedding only at the rows' tokens), each attention layer's keys and values in the filled cache slots once and
  writes the new token's, each DeltaNet layer's recurrent state and convolution window once each way. The report
  gives the ideal at a full cache (what a step reading the whole slab would need) and at the mean fill of a run's
  decode steps (prompt + half the completion): the difference is the slab's empty slots, which the XLA attention
  reads and the decode kernel (``--decode-attention pallas``) does not (the blocks it reads at each step's fill: the
  estimate's "mean fill" figure; the program's text cannot say which blocks a step reads). A sliding-window
  layer's cache is a ring of its window's slots, all read once the sequence is past the window. And the cache's bytes.
- **choose** (``jodpo.sampling.choose``: the sampling filters and the draw over the vocabulary, once a step): its
  bytes in passes over the ``[rows, vocab]`` float32 logits.
- **fused step** (``train_step.jit_online_step``): the FLOPs of its compiled dots, each loop's body counted as many
  times as it runs (``hlo_dot_flops``: XLA's own ``cost_analysis`` counts a loop's body once; the sampler's loop, whose
  trip count depends on when the rows end, as if none ended early), against ``harness.step_flops``'s useful count
  (the 6N-per-token rule with attention) at full-length completions.

XLA counts a fusion's operands and outputs once each: the figures are its model of the traffic, not a profile.
"""
from __future__ import annotations

import math
import re
import tempfile
import time
from pathlib import Path

from harness import config_models, step_flops
from memory import compile_devices, hf_models

MiB = 2 ** 20


def add_parser(sub, defaults: dict) -> None:
    p = sub.add_parser("traffic", help="a decode step's bytes and the fused step's FLOPs, from the compiled programs")
    for k, v in defaults.items():
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--hf-config", metavar="PATH_OR_NAME", help="a real model's config (benchmarks/configs/ names)")
    p.add_argument("--rows", type=int, default=32, help="rows decoded at once (2 x prompts x micro-batches)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--tpu", metavar="TOPOLOGY", help="compile for one chip of this TPU (v5e:1x1, v5p:1x1x1, ...)")
    p.add_argument("--decode-attention", choices=("xla", "pallas"), default="xla",
                   help="the decode steps' attention over the cache (Model.decode_attention)")
    p.add_argument("--no-step", action="store_true", help="the decode step and choose only")
    p.add_argument("--out", type=Path)


def _bytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def ideal_decode_bytes(model, sampler_params, cache, rows: int, filled: float) -> dict:
    """The bytes one decode step must move: weights once (the input embeddings, Gemma 4's per-layer table too: ``rows``
    of them; a mixture of experts' routed experts: those the rows' tokens choose, ``1 - (1 - k/E)^rows`` of them
    expected where routing is uniform), the cache states once (attention: the keys and values of ``filled`` slots
    read, a sliding layer's of its window's at most, the new one written; DeltaNet: its state and window read and
    written), the token and logits negligible."""
    layers, rest = sampler_params["layers"], {k: v for k, v in sampler_params.items() if k != "layers"}
    tables = ("embed", "embed_per_layer")  # read at the rows' tokens
    weights = _bytes(layers) + _bytes({k: v for k, v in rest.items() if k not in tables})
    experts = None
    if model.moe is not None:  # the routed experts: only those some row's token chose, each read once
        per_layer = layers if isinstance(layers, (tuple, list)) else (layers,)  # the sampler's: split per layer
        routed = sum(_bytes(layer["moe"][k]) for layer in per_layer for k in ("gate", "up", "down"))
        share = 1 - (1 - model.moe.top_k / model.moe.num_experts) ** rows  # expected, each row's k drawn uniformly
        weights -= routed * (1 - share)
        experts = {"routed_bytes": routed, "expected_share_read": share}
    if "embed_per_layer" in rest:  # a token's values for every layer
        table = rest["embed_per_layer"]
        weights += rows * table.size // model.per_layer_embeddings.vocab_size * table.dtype.itemsize
    embed = sampler_params["embed"]
    if model.tie_embeddings:  # the LM head reads the whole table
        weights += _bytes(embed)
    else:
        weights += rows * embed.shape[1] * embed.dtype.itemsize
    read = write = 0
    for state in cache["state"]:
        if state is None:  # a KV-sharing layer reads another's keys and values: no state of its own
            continue
        if "k" in state:  # attention: [B, K, S, Dh] slabs (a sliding layer's: a ring of its window's slots)
            per_slot = 2 * state["k"].shape[0] * state["k"].shape[1] * state["k"].shape[3] * state["k"].dtype.itemsize
            read += min(filled, state["k"].shape[2]) * per_slot
            write += per_slot
        else:
            read += _bytes(state)
            write += _bytes(state)
    return {"weights": weights, "cache_read": read, "cache_write": write, "total": weights + read + write,
            **({"experts": experts} if experts else {})}


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")  # a header at column 0: "%name (params) -> ... {"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def hlo_dot_flops(hlo: str, unknown_trips: int) -> float:
    """2 x (output elements) x (contracted size) of every dot of a compiled HLO module, a computation counted each
    time it runs: a while loop's body by its known trip count (``unknown_trips`` where XLA knows none), a
    conditional's costliest branch, fusions and calls by their computations."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            current = comps.setdefault(m.group(1), {"instructions": [], "entry": line.startswith("ENTRY")})
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current["instructions"].append(m.groups())

    def dims(shape_text):
        m = _SHAPE.search(shape_text)
        return [int(d) for d in m.group(1).split(",") if d] if m else []

    memo = {}

    def flops(name):
        if name in memo:
            return memo[name]
        memo[name] = 0.0  # (no recursion in HLO; guards a parse surprise)
        shapes, total = {}, 0.0
        for out, shape, op, rest in comps.get(name, {"instructions": []})["instructions"]:
            shapes[out] = dims(shape)
            called = re.findall(r"(?:calls|body|to_apply)=%?([\w.\-]+)", rest)
            if op == "dot":
                lhs = re.match(r"%?([\w.\-]+)", rest).group(1)
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                k = math.prod(shapes.get(lhs, [1])[int(i)] for i in contracting.group(1).split(",") if i) \
                    if contracting else 1
                total += 2.0 * math.prod(shapes[out]) * k
            elif op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                total += flops(body) * (int(trips.group(1)) if trips else unknown_trips)
            elif op == "conditional":
                branches = re.findall(r"%?([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)) \
                    if "branch_computations" in rest else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)
                total += max((flops(b) for b in branches), default=0.0)
            elif called and op in ("fusion", "call", "async-start", "custom-call"):
                total += sum(flops(c) for c in called)
        memo[name] = total
        return total

    entry = next(n for n, c in comps.items() if c["entry"])
    return flops(entry)


_ARRAY = re.compile(r"(bf16|f32|f16|s32|u32|s8|u8|pred)\[([\d,]*)\](\{[^}]*\})?")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


KERNEL = "jodpo_decode_attention"  # the decode kernel's custom call (jodpo.models.decode_attention)
KERNEL_KV = (6, 7)  # its keys' and values' operands [1, B, K, S, Dh], after the five scalar tables and the queries


def hbm_bytes(hlo: str, kernel_slots=None) -> float:
    """What the entry computation of an XLA:TPU program reads from and writes to HBM, by the memory spaces its layouts
    name (``S(1)``: on-chip VMEM): every operand and output in HBM once, an asynchronous copy or slice into VMEM its
    source once, a gather the rows it takes, an in-place dynamic-update-slice its update (XLA's ``bytes accessed``
    counts the VMEM side of every transfer too, and whole tables for gathers). The decode kernel (``KERNEL``) reads
    only the blocks of its keys and values that hold a filled slot, which the program's text cannot say:
    ``kernel_slots(S)`` is how many of a slab's ``S`` slots it reads (None: all). An estimate from the program's
    text, where a profile is not to be had."""
    def arrays(shape):
        return [(math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dt],
                 int(m.group(1)) if (m := re.search(r"S\((\d+)\)", layout or "")) else 0)
                for dt, dims, layout in _ARRAY.findall(shape)]

    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    symbols = {name: arrays(shape) for name, shape in
               re.findall(r"([\w.\-]+): ((?:bf16|f32|f16|s32|u32|s8|u8|pred)\[[\d,]*\](?:\{[^}]*\})?)", entry[1])}
    total = 0.0
    for line in entry[2:]:
        if not (m := _INSTRUCTION.match(line)):
            continue
        name, shape, op, rest = m.groups()
        outs = symbols[name] = arrays(shape)
        if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant", "copy-done", "slice-done"):
            continue
        operands = [symbols.get(o, []) for o in re.findall(r"%([\w.\-]+)", rest.split("), ")[0])]
        if name.startswith(KERNEL) and kernel_slots is not None:  # its keys and values: the blocks it reads
            shapes = _ARRAY.findall(rest[rest.index("operand_layout_constraints="):])  # its operands', in order
            for i in KERNEL_KV:
                S = int(shapes[i][1].split(",")[3])
                operands[i] = [(b * kernel_slots(S) / S, space) for b, space in operands[i]]
        reads = sum(b for arr in operands for b, space in arr if space == 0)
        writes = sum(b for b, space in outs if space == 0)
        if op in ("copy-start", "slice-start"):  # into VMEM: the source read once
            reads, writes = sum(b for b, space in outs if space == 1), 0
        elif op == "gather" or name.startswith("gather"):
            reads = sum(b for b, _ in outs)
        elif "dynamic_update_slice" in name or op == "dynamic-update-slice":  # in place: the update
            update = sorted(sum(b for b, _ in arr) for arr in operands)[-2] if len(operands) > 1 else 0
            reads = writes = update
        total += reads + writes
    return total


def bench_traffic(a) -> dict:
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo import train_step as ts
    from jodpo.models import params as params_mod
    from jodpo.models.decode_attention import kernel_reads
    from jodpo.sampling import choose, decode_step, sampler_params

    device = compile_devices(a)[0]
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = hf_models(a.hf_config, None, Path(tmp)) if a.hf_config else config_models(a, Path(tmp))
    model = policy.replace(dtype=a.dtype, remat="full", decode_attention=a.decode_attention)
    rm = rm.replace(dtype=a.dtype)
    R, P, T = a.rows, a.prompt_len, a.new_tokens
    on = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)), tree)
    master = params_mod.param_shapes(model, jnp.float32)
    sp = jax.eval_shape(lambda p: sampler_params(model, p), master)
    cache = jax.eval_shape(lambda: jodpo.init_cache(model, R, P + T, per_layer=True))
    tokens = jax.ShapeDtypeStruct((R,), jnp.int32)
    alive = jax.ShapeDtypeStruct((R,), bool)
    out, t0 = {}, time.perf_counter()

    def mean_fill_slots(S):  # the slots of a slab of S the decode kernel reads, over the run's decode steps
        return sum(kernel_reads(S, min(P + t, S)) for t in range(1, T + 1)) / T

    def cost(fn, *args, unknown_trips: int = 1, **kw):
        compiled = jax.jit(fn, **kw).lower(*args).compile()
        c = compiled.cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        text = compiled.as_text()
        hbm = {"hbm_bytes_estimate": hbm_bytes(text), "hbm_bytes_estimate_mean_fill": hbm_bytes(text, mean_fill_slots)}
        return {"bytes_accessed": float(c.get("bytes accessed", 0.0)), "flops": float(c.get("flops", 0.0)),
                "dot_flops_each_loop_counted": hlo_dot_flops(text, unknown_trips),
                **(hbm if device.platform == "tpu" else {})}

    step = cost(lambda p, c, t, al: decode_step(model, p, c, t, al), on(sp), on(cache), on(tokens), on(alive),
                donate_argnums=1)
    full = ideal_decode_bytes(model, sp, cache, R, P + T)
    mean = ideal_decode_bytes(model, sp, cache, R, P + T / 2)
    moved = step.get("hbm_bytes_estimate", step["bytes_accessed"])  # a TPU's HBM, else XLA's own count
    # at the mean fill: what the decode kernel reads then (the XLA attention reads the whole slab at any fill)
    moved_mean = step.get("hbm_bytes_estimate_mean_fill", moved)
    out["decode_step"] = {**step, "ideal_full_cache": full, "ideal_mean_fill": mean, "cache_bytes": _bytes(cache),
                          "over_ideal_full": moved / full["total"], "over_ideal_mean_fill": moved_mean / mean["total"],
                          "compared": "hbm_bytes_estimate" if "hbm_bytes_estimate" in step else "bytes_accessed",
                          "compile_s": time.perf_counter() - t0}
    logits = jax.ShapeDtypeStruct((R, model.vocab_size), jnp.float32)
    sampling = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.9, top_p=0.95, eos_token_ids=(0,))
    c = cost(lambda x, k: choose(x, None, k, sampling), on(logits), on(jax.eval_shape(lambda: jax.random.key(0))))
    out["choose"] = {**c, "passes_over_logits": c["bytes_accessed"] / (R * model.vocab_size * 4),
                     "settings": "temperature 0.9, top_p 0.95"}
    if not a.no_step:
        B = R // 2
        cfg = ts.StepConfig(model=model, reward_model=rm, beta=0.1, missing_eos_penalty=1.0, max_length=P + T,
                            optimizer=ts.OptimizerConfig(learning_rate=5e-7, total_steps=1000),
                            sampling=jodpo.SamplingConfig(max_new_tokens=T, temperature=0.9, eos_token_ids=(0,)))
        state = jax.eval_shape(lambda p: ts.init_state(cfg, p, jax.random.key(0)), master)
        ref = jax.eval_shape(lambda p: params_mod.frozen_params(model, p), master)
        rmp = jax.eval_shape(lambda p: params_mod.frozen_params(rm, p), params_mod.param_shapes(rm, jnp.float32))
        ids = jax.ShapeDtypeStruct((1, B, P), jnp.int32)
        t0 = time.perf_counter()
        chunks = -(-(T - 1) // cfg.sampling.chunk)  # the sampler's loop as if no row ended early
        c = cost(lambda s, r, m, i, k: ts.online_step(cfg, s, r, m, i, k), on(state), on(ref), on(rmp), on(ids),
                 on(ids), unknown_trips=chunks, donate_argnums=0)
        import numpy as np

        shape = dict(vocab=model.vocab_size, hidden=model.hidden_size, layers=model.num_layers)
        useful = 1e9 * step_flops(shape, np.full(B, P), np.full(2 * B, T), P, T)["step"]["useful"]
        out["fused_step"] = {**c, "useful_flops_6n_rule": useful, "compile_s": time.perf_counter() - t0,
                             "over_useful": c["dot_flops_each_loop_counted"] / useful}
    return {"benchmark": "traffic", "model": f"{policy.family}, hidden {model.hidden_size}, {model.num_layers} layers"
            f", vocab {model.vocab_size}" + (f" ({a.hf_config})" if a.hf_config else ""),
            "settings": dict(rows=R, prompt_len=P, new_tokens=T, dtype=a.dtype, tpu=a.tpu,
                             decode_attention=a.decode_attention,
                             device=device.device_kind, platform=device.platform, jax=jax.__version__),
            **out}


def print_traffic(r: dict) -> None:
    s, d = r["settings"], r["decode_step"]
    print(f"{r['model']}: {s['rows']} rows, prompt {s['prompt_len']} + {s['new_tokens']} new, {s['dtype']}, "
          f"compiled for {s['device']} ({s['platform']}), decode attention {s['decode_attention']}")
    f, m = d["ideal_full_cache"], d["ideal_mean_fill"]
    hbm = (f" (HBM, from the memory spaces: {d['hbm_bytes_estimate'] / MiB:,.1f} MiB; at the mean fill "
           f"{d['hbm_bytes_estimate_mean_fill'] / MiB:,.1f} MiB)") if "hbm_bytes_estimate" in d else ""
    print(f"decode step: {d['bytes_accessed'] / MiB:,.1f} MiB accessed{hbm}; ideal {f['total'] / MiB:,.1f} MiB with a full "
          f"cache (weights {f['weights'] / MiB:,.1f}, cache read {f['cache_read'] / MiB:,.1f}, written "
          f"{f['cache_write'] / MiB:,.2f}): {d['over_ideal_full']:.2f}x; at the mean fill "
          f"{m['total'] / MiB:,.1f} MiB: {d['over_ideal_mean_fill']:.2f}x")
    if "experts" in f:
        e = f["experts"]
        print(f"routed experts: {e['routed_bytes'] / MiB:,.1f} MiB, of which the ideal reads the "
              f"{e['expected_share_read']:.1%} a step's {s['rows']} rows choose (uniform routing)")
    print(f"the sampler's cache: {d['cache_bytes'] / MiB:,.1f} MiB")
    c = r["choose"]
    print(f"choose ({c['settings']}): {c['bytes_accessed'] / MiB:,.1f} MiB, {c['passes_over_logits']:.1f} passes over "
          "the float32 logits")
    if "fused_step" in r:
        x = r["fused_step"]
        print(f"fused step: {x['dot_flops_each_loop_counted'] / 1e12:,.3f} TFLOP in its dots (each loop by its trips), "
              f"{x['over_useful']:.2f}x the useful {x['useful_flops_6n_rule'] / 1e12:,.3f} TFLOP")

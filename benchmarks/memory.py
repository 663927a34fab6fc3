"""``bench.py memory``: what the fused online step holds on the device, read from XLA's compiled
``memory_analysis()`` at any shape without allocating it (compiling a Pythia-1B-shaped step needs no GPU and no
weights: the models are built from a ``config.json`` alone, the arrays are ``jax.ShapeDtypeStruct``s).

For the step and each of its pieces (sampling, reward scoring, the update) it reports XLA's argument, output,
aliased (donated and reused) and temporary bytes, and the peak they imply (arguments + outputs - aliased +
temporaries), next to the arithmetic of the big residents: the policy, its gradient and Adam moments, the frozen
reference and reward model, the KV cache and the LM head's logits. The numbers are the buffer assignment of jax's
default backend's compiler, or with ``--tpu TOPOLOGY`` (``v5p:1x1x1``, ``v6e:1x1``, ...) of XLA:TPU's, which libtpu
runs on any machine, without a TPU: one chip of that topology, compiled for ahead of time. A CPU has no bf16
arithmetic and converts bf16 programs to float32, so for a bf16 step the TPU compiler's numbers are the ones to read
(docs/performance.md).
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
from pathlib import Path

from harness import config_models

MiB = 2 ** 20


def _device(a):
    """The device the pieces are compiled for: jax's default one, or one chip of the TPU topology ``a.tpu``
    (``jax.experimental.topologies``: libtpu's compiler, no TPU attached; jax itself stays on the CPU)."""
    import jax
    if not a.tpu:
        return jax.devices()[0]
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise SystemExit("--tpu needs libtpu, the TPU compiler: pip install --target DIR 'libtpu==<the version "
                         "jax[tpu] pins>' and put DIR on PYTHONPATH (docs/performance.md), not into the test "
                         "environment")
    # No TPU metadata server, worker list or accelerator type here: libtpu asks for each (and warns) unless told.
    # Nothing runs on a chip, so another process holding libtpu's lock (a jax that found it installed) is no conflict.
    family, _, dims = a.tpu.partition(":")
    name, cores = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5e": ("v5litepod", 1)}.get(family, (family, 1))
    chips = math.prod(int(d) for d in dims.split("x") if d.isdigit()) or 1
    for k, v in dict(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                     TPU_ACCELERATOR_TYPE=f"{name}-{cores * chips}", ALLOW_MULTIPLE_LIBTPU_LOAD="1").items():
        os.environ.setdefault(k, v)
    jax.config.update("jax_platforms", "cpu")  # jax's own backend: the TPU is only compiled for
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(topology_name=a.tpu, platform="tpu", chips_per_host_bounds=(1, 1, 1),
                                            num_slices=1).devices[0]
    except jax.errors.JaxRuntimeError as e:
        raise SystemExit(f"--tpu {a.tpu}: libtpu does not know this topology ({str(e).splitlines()[0][:200]}); "
                         "give a TPU family and one chip's dimensions, e.g. v5p:1x1x1, v6e:1x1, v5e:1x1, v4:1x1x1")


def _on(device, tree):
    """``tree``'s arrays as ``ShapeDtypeStruct``s placed on ``device`` (what the compile is for)."""
    import jax
    s = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree)


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    r = {k: getattr(m, f"{k}_size_in_bytes") / MiB for k in ("argument", "output", "alias", "temp")}
    r["peak"] = r["argument"] + r["output"] - r["alias"] + r["temp"]
    return {f"{k}_mib": round(v, 3) for k, v in r.items()}


def bench_memory(a) -> dict:
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo import train_step as ts
    from jodpo.models import params as params_mod

    device = _device(a)

    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = config_models(a, Path(tmp))
    compute = "bfloat16" if a.dtype == "bfloat16" else "float32"
    model = policy.replace(dtype=compute, remat=a.remat, attention=a.attention)
    rm = rm.replace(dtype=compute, attention=a.attention)
    cfg = ts.StepConfig(model=model, sampling=jodpo.SamplingConfig(max_new_tokens=a.new_tokens, temperature=0.7,
                                                                   eos_token_ids=(0,), pad_token_id=1),
                        optimizer=ts.OptimizerConfig(learning_rate=5e-7, total_steps=1000), beta=0.1,
                        missing_eos_penalty=1.0, max_length=512, reward_model=rm, loss_type=a.loss_type)
    pdt, fdt = jnp.dtype(a.param_dtype), jnp.dtype(a.frozen_param_dtype)
    params = params_mod.param_shapes(model, pdt)
    # the frozen models as the program keeps them (run.build: frozen_params, their compute form with bf16 compute)
    ref = jax.eval_shape(functools.partial(params_mod.frozen_params, model), params_mod.param_shapes(model, fdt))
    ref = None if cfg.reference_free else ref  # simpo: no reference is held, passed or run (run.build)
    rm_params = jax.eval_shape(functools.partial(params_mod.frozen_params, rm), params_mod.param_shapes(rm, fdt))
    state = jax.eval_shape(lambda p: ts.init_state(cfg, p, jax.random.key(0)), params)
    A, B, P, T = a.accumulation, a.batch, a.prompt_len, a.new_tokens
    ids = jax.ShapeDtypeStruct((A, B, P), jnp.int32)
    samples = jax.eval_shape(lambda s, i: ts.sample_completions(cfg, s, i, i), state, ids)
    rewards = jax.ShapeDtypeStruct((A, 2 * B), jnp.float32)

    pieces, compile_s = {}, {}
    for name, fn, args in (
            ("online_step", ts.jit_online_step, (state, ref, rm_params, ids, ids)),
            ("sample_completions", ts.jit_sample_completions, (state, ids, ids)),
            ("score_completions", ts.jit_score_completions, (rm_params, ids, ids, samples)),
            ("update", ts.jit_update, (state, ref, ids, ids, samples, rewards))):
        t = time.perf_counter()
        try:
            pieces[name] = _analysis(fn.lower(cfg, *_on(device, args)).compile())
        except jax.errors.JaxRuntimeError as e:  # more than the chip's memory: XLA:TPU refuses to compile it
            if not a.tpu:
                raise
            pieces[name] = {"error": str(e).splitlines()[0][:300]}
        compile_s[name] = round(time.perf_counter() - t, 1)

    n = sum(x.size for x in jax.tree.leaves(params))
    n_rm = sum(x.size for x in jax.tree.leaves(rm_params))
    cb = jnp.dtype(compute).itemsize
    rows = 2 * A * B  # the sampler's decode rows: two completions of every prompt of the window
    resident = {
        "policy_params_mib": n * pdt.itemsize / MiB,
        "adam_moments_mib": 2 * n * pdt.itemsize / MiB,
        "gradient_mib": n * pdt.itemsize / MiB,
        "reference_params_mib": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ref)) / MiB,  # 0: none
        "reward_model_params_mib": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(rm_params)) / MiB,
        "sampler_weights_in_compute_dtype_mib": (n * cb / MiB) if cb != pdt.itemsize else 0.0,
        "kv_cache_mib": 2 * a.layers * rows * (P + T) * a.hidden * cb / MiB,
        "lm_head_logits_per_micro_batch_mib": 2 * B * T * a.vocab * 4 / MiB,
    }
    return {"benchmark": "memory",
            "model": f"GPT-NeoX, hidden {a.hidden}, {a.layers} layers, {a.heads} heads, vocab {a.vocab}",
            "settings": dict(batch=B, accumulation=A, prompt_len=P, new_tokens=T, dtype=a.dtype, remat=a.remat,
                             loss_type=a.loss_type,
                             param_dtype=a.param_dtype, frozen_param_dtype=a.frozen_param_dtype,
                             attention=a.attention, device=device.device_kind, platform=device.platform),
            "parameters": n, "reward_model_parameters": n_rm,
            "resident": {k: round(v, 3) for k, v in resident.items()}, "compiled": pieces, "compile_s": compile_s}


def print_memory(r: dict) -> None:
    print(f"{r['model']}; {json.dumps(r['settings'])}")
    print(f"parameters: policy {r['parameters'] / 1e9:.3f} B, reward model {r['reward_model_parameters'] / 1e9:.3f} B")
    for k, v in r["resident"].items():
        print(f"  {k:<40} {v:>10.1f} MiB")
    print(f"{'XLA memory_analysis (MiB)':<22} {'argument':>10} {'output':>10} {'aliased':>10} {'temp':>10} {'peak':>10}")
    for name, m in r["compiled"].items():
        if "error" in m:
            print(f"{name:<22} {m['error']}")
            continue
        print(f"{name:<22} {m['argument_mib']:>10.1f} {m['output_mib']:>10.1f} {m['alias_mib']:>10.1f} "
              f"{m['temp_mib']:>10.1f} {m['peak_mib']:>10.1f}")


def add_parser(sub, defaults: dict) -> None:
    p = sub.add_parser("memory", help="the fused step's device memory from XLA's memory_analysis (no weights)")
    for k in ("vocab", "hidden", "layers", "heads"):
        p.add_argument(f"--{k}", type=int, default=defaults[k])
    p.add_argument("--batch", type=int, default=8, help="prompts per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--prompt-len", type=int, default=128, help="the prompt bucket (tldr.py's ~70 tokens: 128)")
    p.add_argument("--new-tokens", type=int, default=53)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--frozen-param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    p.add_argument("--attention", choices=("xla", "cudnn"), default="xla")
    p.add_argument("--loss-type", default="sigmoid", help="the step's loss_type; a reference-free one (simpo) "
                   "compiles the step without a reference model")
    p.add_argument("--tpu", metavar="TOPOLOGY", help="compile for one chip of this TPU topology (e.g. v5p:1x1x1, "
                   "v6e:1x1) with libtpu, ahead of time, on any machine; default: jax's default device")
    p.add_argument("--out", type=Path)

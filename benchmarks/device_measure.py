"""The device check's timed measurements, run in a process of their own (``bench.py _device_step SPEC``): a ~1.7B
GPT-NeoX in bf16 built from a ``config.json`` with random weights on the device, then, each recorded to
``spec["out"]`` as soon as it is done (a process stopped at its time limit keeps what it finished):

- ``sampler``: two completions of every prompt (``jit_sample_completions``), completion tokens/s, MFU, and the share
  of its bandwidth bound it reaches (``decode_bound_s``);
- ``step``: the fused online step (``jit_online_step``: sample, score, update), episodes/s and MFU;
- ``variants``: the same sampler, or the update alone (``jit_update`` on the sampled pairs), under one changed choice
  each (``spec["variants"]``: rows decoded at once, scan unrolling, the attention kernel, the rematerialisation
  policy), timed in this process right after the default, so the ratios compare like with like; and the sampler and
  the fused step of another family's real shape (``"what": "family"``: a ``benchmarks/configs`` name, e.g. the
  hybrid Qwen3.5-2B, with random weights), at the same batch and lengths.

Which package and XLA flags the process runs with is the caller's (device.py starts one process per flag set, and one
on a previous version of jodpo: ``--baseline``); this module reads jodpo's public names only.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np
from harness import config_models, jax_memory_bandwidth, jax_matmul_peak, step_flops, timed
from memory import hf_config_file

# nominal dense bf16 TFLOP/s by device kind (the first fragment found in jax's device_kind wins)
NOMINAL_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0), ("L4", 121.0))


def decode_bound_s(a, n_params: int, rows: int, steps: int, bandwidth: float) -> float:
    """Seconds the ``steps`` decode steps of ``rows`` rows need at least, at ``bandwidth`` bytes/s: each reads every
    weight once in bf16 (the input embedding only at its rows: not counted) and the keys and values of the filled
    cache slots once (the prompt's and the completion's so far); the new tokens' bytes are negligible."""
    weights = 2 * (n_params - a.vocab * a.hidden)
    kv_per_slot = rows * a.layers * 2 * a.hidden * 2  # K and V, bf16, every layer
    slots = sum(a.prompt_len + t for t in range(1, steps + 1))
    return (steps * weights + kv_per_slot * slots) / bandwidth


def profile_summary(trace_dir: Path, top: int = 30) -> dict:
    """What a ``jax.profiler`` trace (its perfetto JSON) says the accelerator did: per kernel name its calls and
    microseconds on the device's streams, the streams' busy time against the traced span, and the host's waits
    (synchronisations and device-to-host copies, where a branch's predicate is read). Nothing device-side on a CPU."""
    import collections
    import gzip

    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return {"error": "no perfetto trace written"}
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device, host = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        on_device = "/device:" in names.get(e.get("pid"), "")
        table = device if on_device else host
        table[e["name"]][0] += 1
        table[e["name"]][1] += e.get("dur", 0.0)
        if on_device:
            spans.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    busy, end = 0.0, None  # the union of the device's intervals
    for a, b in sorted(spans):
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    waits = {k: v for k, v in host.items() if any(w in k for w in ("ynchron", "Memcpy", "DtoH", "Wait"))}
    rank = lambda t: [{"name": k[:160], "calls": n, "us": round(us, 1)}  # noqa: E731
                      for k, (n, us) in sorted(t.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"device_kernels": sum(n for n, _ in device.values()), "device_busy_us": round(busy, 1),
            "device_span_us": round(max(b for _, b in spans) - min(a for a, _ in spans), 1) if spans else 0.0,
            "top_kernels": rank(device), "host_waits": rank(waits)}


def run(spec: dict) -> None:
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo import train_step as ts
    from jodpo.models.params import frozen_params

    out, r = Path(spec["out"]), {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                                 "jodpo": str(Path(jodpo.__file__).parent)}

    def save(**kv):
        r.update(kv)
        out.write_text(json.dumps(r, indent=2))

    a = types.SimpleNamespace(**spec)
    nominal = a.nominal_peak_tflops or next((v for k, v in NOMINAL_BF16_TFLOPS if k in r["device_kind"]), None)
    save(nominal_peak_tflops=nominal, matmul_peak_tflops=jax_matmul_peak("bfloat16", 3, a.peak_size) / 1e3,
         memory_bandwidth_gbps=jax_memory_bandwidth() / 1e9)
    peak, bandwidth = (1e12 * nominal if nominal else None), 1e9 * r["memory_bandwidth_gbps"]
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = config_models(a, Path(tmp))
    model, rm = policy.replace(dtype="bfloat16", remat="full"), rm.replace(dtype="bfloat16")
    cfg = ts.StepConfig(model=model, reward_model=rm, beta=0.1, missing_eos_penalty=1.0, max_length=a.prompt_len +
                        a.new_tokens, optimizer=ts.OptimizerConfig(learning_rate=5e-7, total_steps=1000),
                        sampling=jodpo.SamplingConfig(max_new_tokens=a.new_tokens, temperature=0.9,
                                                      eos_token_ids=(0,), pad_token_id=1))
    t = time.perf_counter()
    params = jodpo.init_params(model, jax.random.key(0), jnp.float32)
    ref = frozen_params(model, params)  # the reference as the program holds it: bf16, as its forwards read it
    rm_params = frozen_params(rm, jodpo.init_params(rm, jax.random.key(1), jnp.float32))
    state = ts.init_state(cfg, params, jax.random.key(2))
    del params
    prompts = lambda b: jax.random.randint(jax.random.key(3), (1, b, a.prompt_len), 2, a.vocab, jnp.int32)  # noqa: E731
    ids = prompts(a.batch)
    mask = jnp.ones_like(ids)
    jax.block_until_ready((state, ref, rm_params))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    save(parameters=n_params, init_s=time.perf_counter() - t)
    lens_p = np.full(a.batch, a.prompt_len)

    def repeat(fn):
        """(compile + first call s, the median of ``a.steps`` timed calls, their times, the last result)"""
        first = timed(lambda: jax.block_until_ready(fn()))
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            res = jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return first, statistics.median(times), times, res

    def sampler(step_cfg, batch):
        ids_, mask_ = (ids, mask) if batch == a.batch else (prompts(batch), jnp.ones((1, batch, a.prompt_len),
                                                                                     jnp.int32))
        first, med, times, samples = repeat(lambda: ts.jit_sample_completions(step_cfg, state, ids_, mask_))
        lens_c = np.asarray(samples.mask).sum(-1).ravel()
        flops = 1e9 * step_flops(vars(a), np.full(batch, a.prompt_len), lens_c, a.prompt_len,
                                 a.new_tokens)["sampling"]["useful"]
        bound = decode_bound_s(a, n_params, 2 * batch, int(lens_c.max()) - 1, bandwidth)
        prefill = 1e9 * step_flops(vars(a), np.full(batch, a.prompt_len), np.ones(2 * batch, int), a.prompt_len,
                                   1)["sampling"]["useful"] / (1e12 * r["matmul_peak_tflops"])
        return samples, {"compile_plus_first_s": first, "times_s": times, "median_s": med, "rows": 2 * batch,
                         "completion_tokens": int(lens_c.sum()), "tokens_per_s": float(lens_c.sum()) / med,
                         "useful_tflops_per_s": flops / med / 1e12, "mfu_nominal": flops / med / peak if peak else None,
                         "bound_s": bound + prefill, "bandwidth_fraction": (bound + prefill) / med}

    samples, x = sampler(cfg, a.batch)
    save(sampler=x)
    if spec.get("profile") and jax.default_backend() != "cpu":  # one more call of the sampler, traced
        trace = out.parent / f"{out.stem}-profile"
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            jax.block_until_ready(ts.jit_sample_completions(cfg, state, ids, mask))
        save(sampler_profile=profile_summary(trace))
        for f in trace.rglob("*"):  # the summary and the perfetto trace come back; the raw xplane is large
            if f.is_file() and not f.name.startswith("perfetto"):
                f.unlink()
    lens_c = np.asarray(samples.mask).sum(-1).ravel()
    flops = step_flops(vars(a), lens_p, lens_c, a.prompt_len, a.new_tokens)
    measured = 1e12 * r["matmul_peak_tflops"]

    def mfu(useful, med):
        return {"useful_tflop": useful / 1e12, "useful_tflops_per_s": useful / med / 1e12,
                "mfu_nominal": useful / med / peak if peak else None, "mfu_measured_peak": useful / med / measured}

    def fused_step(step_cfg):
        """The fused step (sample, score on device, update; the state donated), timed."""
        nonlocal state
        holder = {"state": state}

        def fused():
            holder["state"], metrics, new, _ = ts.jit_online_step(step_cfg, holder["state"], ref, rm_params, ids, mask)
            return metrics, new

        first, med, times, (metrics, new) = repeat(fused)
        state = holder["state"]
        c = np.asarray(new.mask).sum(-1).ravel()
        return {"compile_plus_first_s": first, "times_s": times, "median_s": med, "episodes_per_s": a.batch / med,
                "loss": float(metrics["loss"]),
                **mfu(1e9 * step_flops(vars(a), lens_p, c, a.prompt_len, a.new_tokens)["step"]["useful"], med)}

    def family(name: str, shrink: dict | None, override: dict | None = None):
        """Sampler and fused step of a real config (``override``: fields changed, e.g. fewer layers of a model too
        big for the chip's memory with its optimizer state; ``shrink``: the dry run's tiny model), random weights in
        bf16: seconds and tokens/s (its FLOPs are not GPT-NeoX's: no MFU)."""
        from jodpo.models.loading import model_from_dir

        raw = json.loads(hf_config_file(name).read_text()) | (override or {}) | (shrink or {})
        models = []
        with tempfile.TemporaryDirectory() as tmp:
            for task, arch in (("causal_lm", "ForCausalLM"), ("reward", "ForSequenceClassification")):
                (Path(tmp) / task).mkdir()
                stem = raw["architectures"][0].removesuffix("ForCausalLM")
                (Path(tmp) / task / "config.json").write_text(json.dumps(
                    raw | {"architectures": [stem + arch]} | ({"num_labels": 1} if task == "reward" else {})))
                models.append(model_from_dir(Path(tmp) / task, task, "float32"))
        m, r = models[0].replace(dtype="bfloat16", remat="full"), models[1].replace(dtype="bfloat16")
        cfg_f = dataclasses.replace(cfg, model=m, reward_model=r)
        p = jodpo.init_params(m, jax.random.key(5), jnp.float32)
        ref_f, rm_f = frozen_params(m, p), frozen_params(r, jodpo.init_params(r, jax.random.key(6), jnp.float32))
        st = ts.init_state(cfg_f, p, jax.random.key(7))
        del p
        first_s, med_s, _, samples_f = repeat(lambda: ts.jit_sample_completions(cfg_f, st, ids, mask))
        holder = {"state": st}

        def step():
            holder["state"], metrics, _, _ = ts.jit_online_step(cfg_f, holder["state"], ref_f, rm_f, ids, mask)
            return metrics

        first, med, times, _ = repeat(step)
        tokens = int(np.asarray(samples_f.mask).sum())
        return {"config": name, **({"override": override} if override else {}),
                "parameters": sum(x.size for x in jax.tree.leaves(holder["state"].params)),
                "sampler_median_s": med_s, "sampler_compile_plus_first_s": first_s, "rows": 2 * a.batch,
                "tokens_per_s": tokens / med_s, "compile_plus_first_s": first, "times_s": times, "median_s": med,
                "episodes_per_s": a.batch / med}

    if spec.get("step", True):
        save(step=fused_step(cfg), device_peak_mib=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
             / 2 ** 20 if jax.default_backend() != "cpu" else None)

    rewards = jax.random.normal(jax.random.key(4), samples.mask.shape[:2], jnp.float32)
    update_flops = 1e9 * (flops["reference_logprobs"]["useful"] + flops["policy_fwd_bwd"]["useful"])
    variants = {}
    for v in spec.get("variants", ()):
        v = dict(v)
        name, what = v.pop("name"), v.pop("what")
        choices = {k: v.pop(k) for k in ("attention", "remat") if k in v}
        model_v, rm_v = model.replace(**choices), rm.replace(**{k: x for k, x in choices.items() if k == "attention"})
        batch = a.batch * v.pop("batch_factor", 1)
        config, override = v.pop("config", None), v.pop("override", None)
        cfg_v = dataclasses.replace(cfg, model=model_v, reward_model=rm_v,
                                    sampling=dataclasses.replace(cfg.sampling, **v))
        try:
            if what == "sampler":
                variants[name] = sampler(cfg_v, batch)[1]
            elif what == "step":
                variants[name] = fused_step(cfg_v)
            elif what == "family":
                variants[name] = family(config, (spec.get("shrink") or {}).get(config), override)
            else:  # the update alone, on the pairs sampled above
                holder = {"state": state}

                def upd():
                    holder["state"], metrics = ts.jit_update(cfg_v, holder["state"], ref, ids, mask, samples, rewards)
                    return metrics

                first, med, times, _ = repeat(upd)
                state = holder["state"]
                variants[name] = {"compile_plus_first_s": first, "times_s": times, "median_s": med,
                                  **mfu(update_flops, med)}
        except Exception as e:  # a choice this machine cannot run (cuDNN on a CPU, memory): said, and the next one
            variants[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        save(variants=variants)

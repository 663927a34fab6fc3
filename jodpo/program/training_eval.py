"""Evaluation during training: one completion per evaluation prompt, scored as training scores (the reward
model on the device, reward functions on the host, or a judge against the references), and the win rate
against the dataset's reference completions when it has them.

``compile_evaluation`` compiles the evaluation's programs in a background thread once the run's first step is
dispatched, so that the first evaluation costs what the later ones cost: on an accelerator the host's cores idle
while the step runs.
"""
from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.program import data as D
from jodpo import judges as J
from jodpo.program import rewards as R
from jodpo.parallel import sharding as S
from jodpo.program.run import Run

log = logging.getLogger("jodpo")


def _eval_batches(run: Run):
    """Index arrays of the evaluation batches: as many whole multiples of the data-parallel size as the set has
    (build() turns evaluation off for a set smaller than the data-parallel size)."""
    dp = S.data_parallel_size(run.mesh)
    B = min(run.cfg.per_device_eval_batch_size * dp, len(run.eval) // dp * dp)
    return [np.arange(start, start + B) for start in range(0, len(run.eval) - B + 1, B)]


def _eval_prompts(run: Run, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """i32[1, B, P] host ids and mask of the evaluation prompts ``idx``, in the training buckets' shapes (so each
    shape compiles once for the whole run)."""
    return D.prompt_batch([run.eval.ids[i] for i in idx], 1, run.buckets, run.step_cfg.sampling.pad_token_id)


def _eval_state(state):
    """The state the evaluation samples with. Every evaluation draws with the same key (step -1, never a training
    step): scores at different steps differ by the policy, not by the draw. With async_mode it evaluates the
    current policy, not the lagging sampler."""
    eval_state = state.replace(step=jnp.int32(-1))
    if eval_state.sampler_params is not None:
        eval_state = eval_state.replace(sampler_params=state.params)
    return eval_state


def _reference_scores(run: Run, batches) -> np.ndarray | None:
    """The rewards of the evaluation set's reference completions (the rewards are frozen: ``Evaluation`` keeps
    them for the run)."""
    data = run.eval
    if data.references is None:
        return None
    return np.concatenate([
            run.rewards.score([data.prompts[i] for i in idx], [data.references[i] for i in idx],
                              run.tokenizer([data.references[i] for i in idx], add_special_tokens=False)["input_ids"],
                              {k: [v[i] for i in idx] for k, v in data.columns.items()}) for idx in batches])


def _reference_batches(run: Run) -> list[tuple[np.ndarray, np.ndarray]]:
    """The reward model's inputs (ids, mask) of the reference completions, one per distinct shape, when the first
    evaluation will score them with the reward model (``_reference_scores``); else none."""
    data = run.eval
    if run.judge is not None or data.references is None or run.rewards.model is None:
        return []
    shapes = {}
    for idx in _eval_batches(run):
        ids, mask = R.text_batch(run.rewards.model, run.rewards.tokenizer, [data.prompts[i] for i in idx],
                                 [data.references[i] for i in idx])
        shapes.setdefault(ids.shape, (ids, mask))
    return list(shapes.values())


def judge_against(judge, prompts: list, references: list[str], completions: list[str]) -> np.ndarray:
    """f32[B]: the judge's probability that ``references[b]`` (the dataset's, or a baseline's) beats the policy's
    ``completions[b]`` (TRL's judge_tldr puts the reference first too); NaN: no verdict. Chat prompts: both as the
    assistant's messages. The in-run evaluation and ``python -m jodpo.evaluate`` judge through it."""
    if isinstance(prompts[0], list):
        references, completions = D.assistant_messages(references), D.assistant_messages(completions)
    return judge.preferences(prompts, references, completions)


def _judge_against_references(run: Run, idx: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    data = run.eval
    return judge_against(run.judge, [data.prompts[i] for i in idx], [data.references[i] for i in idx],
                         run.decode(tokens))


def eval_samples(run: Run, state):
    """Yields ``(idx, ids, mask, samples)`` per evaluation batch: one completion per prompt (dispatched, not
    waited for)."""
    eval_state = _eval_state(state)
    for idx in _eval_batches(run):
        ids, mask = map(run.put, _eval_prompts(run, idx))
        yield idx, ids, mask, run.steps.sample_completions(run.step_cfg, eval_state, ids, mask, 1, run.ref_params)


def _scored_on_device(run: Run) -> bool:
    return run.judge is None and run.rewards.on_device


def evaluate(run: Run, state, references=None) -> dict:
    """One completion per evaluation prompt (``eval_samples``), scored; with reference completions, the win rate
    against them (by the rewards, or by the judge: then the win rate is all there is). ``references``: a function
    giving the references' rewards (``Evaluation`` keeps them), else they are scored now."""
    scores = []
    for idx, ids, mask, samples in eval_samples(run, state):
        if run.judge is not None:  # the chance that the reference is the better one
            s = _judge_against_references(run, idx, S.to_host(samples.tokens)[0])
        elif _scored_on_device(run):  # as in training: the reward model reads the token ids on the device
            s = S.to_host(run.steps.score_completions(run.step_cfg, run.rewards.params, ids, mask, samples))[0]
        else:
            s = run.score_on_host(run.eval, list(idx), S.to_host(samples.tokens)[0], S.to_host(samples.mask)[0])
        scores.append(np.asarray(s, np.float32))
    if not scores:
        return {}
    scores, prefix = np.concatenate(scores), run.eval_prefix  # "eval/...", or "eval_<name>/..." for a dict's sets
    if run.judge is not None:
        return {f"{prefix}/win_rate": J.win_rate(scores)}
    out = {f"{prefix}/objective/scores": float(np.mean(scores))}
    references = (references or _reference_scores)(run, _eval_batches(run))
    if references is not None:
        out[f"{prefix}/win_rate"] = float(np.mean(scores > references))
    return out


class Evaluation:
    """A run's evaluation as the loop runs it, over each of its evaluation sets: their programs compiled in the
    background after the first step (``start_compiling``), waited for before the first evaluation, and the
    references' rewards scored once per set."""

    def __init__(self, run: Run):
        self.run, self.runs = run, [run.one_eval(i) for i in range(len(run.evals))]
        self.compiling, self.references = None, {}

    def start_compiling(self, state) -> None:
        self.compiling = compile_evaluation(self.run, state)

    def wait(self) -> None:
        """The background compile, finished (a run stopped before its first evaluation waits for it too)."""
        if self.compiling is not None:  # its programs: wait rather than compile twice
            self.compiling.join()
            self.compiling = None

    def __call__(self, state) -> dict:
        self.wait()
        out = {}
        for run in self.runs:
            out |= evaluate(run, state, self._reference_scores)
        return out

    def _reference_scores(self, run: Run, batches):
        if run.eval_prefix not in self.references:
            self.references[run.eval_prefix] = _reference_scores(run, batches)
        return self.references[run.eval_prefix]


def compile_evaluation(run: Run, state) -> threading.Thread | None:
    """Start compiling the evaluation's programs for each of the run's evaluation sets (its sampling and,
    with the reward model on the device, its scoring, once per prompt shape of all the sets; and the reward model's
    scoring of the reference completions, once per run) in a background thread, with the exact arguments
    ``evaluate`` passes, so that its calls find them compiled; returns the thread (``Evaluation`` waits for it). A
    failure only logs: the evaluation then compiles when it first runs. None when the run does not evaluate. The
    thread only compiles: it runs nothing on the devices (a multi-process run must launch its programs in the same
    order on every process)."""
    if run.eval is None:
        return None
    runs = [run.one_eval(i) for i in range(len(run.evals))]  # they share everything but their prompts
    # Shapes and shardings only: the step donates the state's buffers while this thread works.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    eval_state = _eval_state(abstract)
    shapes, references = {}, {}
    for each in runs:
        for idx in _eval_batches(each):
            ids, mask = _eval_prompts(each, idx)
            shapes.setdefault(ids.shape, (ids, mask))
        for ids, mask in _reference_batches(each):  # tokenized here: the tokenizer is not used from two threads
            references.setdefault(ids.shape, (ids, mask))

    def work():
        try:
            for host_ids, host_mask in shapes.values():
                # abstract, never placed: a transfer from this thread while the step runs on XLA:CPU's two threads
                # (a 2-core machine) was seen to leave the step waiting for ever (a Qwen3.5 run, jaxlib 0.10.2)
                ids, mask = run.abstract(host_ids), run.abstract(host_mask)
                sample = run.steps.sample_completions.lower(run.step_cfg, eval_state, ids, mask, 1,
                                                            run.ref_params).compile()
                if _scored_on_device(run):
                    run.steps.score_completions.lower(run.step_cfg, run.rewards.params, ids, mask,
                                                      sample.out_info).compile()
            for ids, mask in references.values():
                ids, mask = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (ids, mask))
                R.jit_reward_scores.lower(run.rewards.model, run.rewards.params, ids, mask).compile()
        except Exception as e:  # noqa: BLE001 - only a head start: the evaluation compiles as usual without it
            log.warning("compiling the evaluation in the background failed (%s: %s); it compiles at the first "
                        "evaluation instead", type(e).__name__, e)

    thread = threading.Thread(target=work, name="jodpo-eval-compile", daemon=True)
    thread.start()
    return thread

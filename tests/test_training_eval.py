"""The evaluation's programs compile in the background from a run's first step, with the arguments the evaluation
passes: its first call then compiles nothing (and the background compile does not change what it computes)."""
import logging

import jax
import pytest

from jodpo.program import loop
from jodpo.program import training_eval as evaluation
from jodpo.program import run
from jodpo.program.config import TrainConfig
from tests import hf_fixtures

SAMPLE_AND_SCORE = ("jit(sample_completions)", "jit(score_completions)")  # once per prompt shape
REFERENCES = "jit(reward_scores)"  # the reward model's scores of the reference completions, once per run


def _compiled(caplog) -> list[str]:
    return [p for r in caplog.records for p in (*SAMPLE_AND_SCORE, REFERENCES)
            if f"Finished XLA compilation of {p}" in r.getMessage()]


@pytest.fixture
def log_compiles(caplog):
    """jax's compile messages, from every thread (``jax.log_compiles`` would only raise the calling thread's)."""
    caplog.set_level(logging.DEBUG, logger="jax._src.dispatch")
    return caplog


def _programs(built) -> list[str]:
    """What the first evaluation of ``built`` needs compiled: sampling and scoring per prompt shape, and the
    references' scoring per shape of their batches."""
    shapes = {evaluation._eval_prompts(built, idx)[0].shape for idx in evaluation._eval_batches(built)}
    return sorted(SAMPLE_AND_SCORE * len(shapes) + (REFERENCES,) * len(evaluation._reference_batches(built)))


def test_the_first_evaluation_compiles_nothing_after_the_background_compile(checkpoints, tmp_path, log_compiles):
    jax.clear_caches()  # the references' scorer is one jitted function for every run of the session
    data = hf_fixtures.prompt_dataset(tmp_path / "data")
    cfg = TrainConfig(model_name_or_path=str(checkpoints["neox"]["causal_lm"]),
                      reward_model_path=str(checkpoints["neox"]["reward"]), dataset_name=str(data),
                      max_new_tokens=5, max_length=160, max_prompt_length=128, per_device_eval_batch_size=4,
                      eval_strategy="steps", eval_steps=1,
                      prompt_buckets=(56, 64, 128), output_dir=str(tmp_path / "out"))
    built = run.build(cfg)
    state = loop.initial_state(built)
    needed = _programs(built)
    assert needed.count(SAMPLE_AND_SCORE[0]) == 2 and REFERENCES in needed  # two batches in two buckets
    reference = evaluation.evaluate(built, state)  # compiled as it runs
    assert sorted(_compiled(log_compiles)) == needed

    built = run.build(cfg.replace(per_device_eval_batch_size=2))  # new shapes, nothing compiled yet
    state = loop.initial_state(built)
    log_compiles.clear()
    evaluation.compile_evaluation(built, state).join()
    assert sorted(_compiled(log_compiles)) == _programs(built)
    log_compiles.clear()
    out = evaluation.evaluate(built, state)
    assert _compiled(log_compiles) == []
    assert set(out) == set(reference) == {"eval/objective/scores", "eval/win_rate"}

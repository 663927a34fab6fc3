"""Pairwise judges: the LLM judge equals transformers on the same text, both orders average, callable judges'
verdicts, the loss with a judge's pairs, config errors, and a run paired by a callable judge."""
import json
import math

import numpy as np
import pytest

import jodpo
from jodpo.program import config as C
from jodpo import judges as J
from jodpo.program import user_code
from jodpo.program import loop
from jodpo.losses import online_dpo_loss
from tests import hf_fixtures
from tests import references

PROMPTS = ["SUBREDDIT: r/test POST: hello world TL;DR:", [{"role": "user", "content": "the lazy dog"}]]
FIRST = [" the quick brown fox", [{"role": "assistant", "content": "hello jax"}]]
SECOND = [" lazy dog jumps", [{"role": "assistant", "content": "a short summary of the post"}]]


@pytest.fixture(scope="module")
def judge_parts(checkpoints):
    path = checkpoints["qwen2"]["causal_lm"]
    model, params = jodpo.load_model(str(path), "causal_lm")
    return path, model, params, jodpo.load_tokenizer(str(path))


@pytest.mark.parametrize("both_orders", [False, True])
def test_llm_judge_equals_transformers(judge_parts, both_orders):
    path, model, params, tok = judge_parts
    judge = J.LLMJudge(model, params, tok, both_orders=both_orders)
    got = judge.preferences(PROMPTS, FIRST, SECOND)
    ab = references.transformers_p_first(path, [references.reference_text(tok, *x) for x in zip(PROMPTS, FIRST, SECOND)])
    expect = ab
    if both_orders:
        ba = references.transformers_p_first(path, [references.reference_text(tok, *x) for x in zip(PROMPTS, SECOND, FIRST)])
        expect = (ab + 1 - ba) / 2
    np.testing.assert_allclose(got, expect, atol=1e-4)
    assert np.all(np.abs(ab - 0.5) > 1e-3), "the random tiny judge must have an opinion for this test to bite"


def test_both_orders_make_the_judge_symmetric(judge_parts):
    """Averaged over both orders, swapping the completions gives exactly 1 - p; one order alone does not."""
    _, model, params, tok = judge_parts
    both = J.LLMJudge(model, params, tok)
    np.testing.assert_allclose(both.preferences(PROMPTS, FIRST, SECOND) + both.preferences(PROMPTS, SECOND, FIRST),
                               1.0, atol=1e-6)
    one = J.LLMJudge(model, params, tok, both_orders=False)
    assert np.abs(one.preferences(PROMPTS, FIRST, SECOND) + one.preferences(PROMPTS, SECOND, FIRST) - 1).max() > 1e-4


def test_llm_judge_prompt_and_answers(judge_parts, tmp_path):
    _, model, params, tok = judge_parts
    template = "Which is better for {prompt}? A: {response0} B: {response1}. Answer A or B:"
    file = tmp_path / "judge.txt"
    file.write_text(template)
    assert J.read_template(str(file)) == template and J.read_template(None) == J.DEFAULT_PAIRWISE_PROMPT
    judge = J.LLMJudge(model, params, tok, template, answers=("A", "B"))
    assert "Which is better for hi? A: x B: y." in judge.text("hi", "x", "y")
    assert judge.preferences(["hi"], ["x"], ["y"]).shape == (1,)
    with pytest.raises(J.JudgeError, match="response1"):
        J.LLMJudge(model, params, tok, "{prompt} {response0}")
    with pytest.raises(J.JudgeError, match="one token each"):
        J.LLMJudge(model, params, tok, answers=("first", "second"))


def prefer_shorter(prompts, completions):
    """A callable judge (TRL's shape): the shorter completion wins; no verdict on equal lengths."""
    return [-1 if len(a) == len(b) else int(len(b) < len(a)) for a, b in completions]


class ShorterJudge:
    def judge(self, prompts, completions, shuffle_order=True):
        return [None if len(a) == len(b) else int(len(b) < len(a)) for a, b in completions]


def test_callable_judges_verdicts():
    for spec in ("tests.test_judges:prefer_shorter", "tests.test_judges:ShorterJudge"):
        judge = user_code.import_judge(spec)
        p = judge.preferences(["p"] * 3, ["ab", "abc", "xy"], ["abc", "ab", "zw"])
        np.testing.assert_array_equal(p[:2], [1.0, 0.0])
        assert math.isnan(p[2])
    with pytest.raises(ValueError, match="cannot be imported"):
        user_code.import_judge("tests.test_judges:nothing_here")
    bad = J.CallableJudge(lambda prompts, pairs: [2] * len(pairs), "bad")
    with pytest.raises(J.JudgeError, match="returned 2"):
        bad.preferences(["p"], ["a"], ["b"])
    assert user_code.is_import_path("pkg.mod:fn") and not user_code.is_import_path("Qwen/Qwen2.5-1.5B-Instruct")
    assert J.win_rate(np.array([0.2, 0.9, 0.5, np.nan])) == pytest.approx(0.5)


def test_loss_with_a_judge_leaves_out_pairs_without_a_verdict(checkpoints):
    """The judged loss equals the loss of the judged pairs alone, and logs the judge's metrics, not scores'."""
    import jax

    model, ref = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    params = jax.tree.map(lambda w: w * 1.1, ref)  # a policy that differs from its reference
    rng = np.random.default_rng(0)
    B = 3
    ids, mask = hf_fixtures.padded_batch(rng, [5, 3, 4], model.pad_token_id, "left")
    tokens, tmask = hf_fixtures.padded_batch(rng, [4, 2, 3, 4, 4, 1], model.pad_token_id, "right")
    p = np.array([0.9, np.nan, 0.2], np.float32)
    loss, m = online_dpo_loss(model, params, ref, ids, mask, tokens, tmask, J.pair_scores(p), beta=0.1, judged=True)
    keep = np.array([0, 2])
    two = np.concatenate([keep, keep + B])
    sub_loss, sub_m = online_dpo_loss(model, params, ref, ids[keep], mask[keep], tokens[two], tmask[two],
                                      J.pair_scores(p[keep]), beta=0.1, judged=True)
    np.testing.assert_allclose(loss, sub_loss, rtol=1e-5)
    assert abs(float(m["rewards/margins"])) > 1e-3
    for k in ("rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(m[k], sub_m[k], rtol=1e-5)
    assert float(m["objective/judge_abstained"]) == pytest.approx(1 / 3)
    assert float(m["objective/judge_confidence"]) == pytest.approx(0.85)
    assert "objective/scores" not in m and "objective/rlhf_reward" not in m and "objective/kl" in m


def test_config_errors():
    with pytest.raises(C.ConfigError, match="judge and reward_model_path"):
        C.TrainConfig(judge="m:f", reward_model_path="rm")
    with pytest.raises(C.ConfigError, match="missing_eos_penalty"):
        C.TrainConfig(judge="m:f", missing_eos_penalty=1.0)
    with pytest.raises(C.ConfigError, match="judge_answer_tokens"):
        C.TrainConfig(judge="m:f", judge_answer_tokens=("0",))


def test_a_callable_judge_trains_end_to_end(checkpoints, tmp_path):
    """A run paired by a judge that prefers shorter completions, out of three per prompt (num_generations=3: the
    judge's round robin ranks them), training LoRA adapters: the judge's metrics and the ranking's are logged, the
    reward metrics are not, and the evaluation's win rate comes from the judge. (configs/ultrafeedback_qwen2_judge.py
    runs an LLM judge on chat data, two completions per prompt, in tests/test_train.py.)"""
    cfg = C.TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                        judge="tests.test_judges:prefer_shorter",
                        dataset_name=str(hf_fixtures.prompt_dataset(tmp_path / "data")),
                        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                        learning_rate=1e-3, logging_steps=1, max_new_tokens=8, max_length=120, bf16=False,
                        eval_strategy="steps", eval_steps=3, max_eval_prompts=4, per_device_eval_batch_size=4,
                        num_generations=3, use_peft=True, lora_r=4)
    last = loop.train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("objective/judge_confidence" in m and "objective/scores" not in m for m in steps)
    assert all(0 <= m["frac_reward_zero_std"] <= 1 and m["objective/scores_spread"] > 0 for m in steps)
    assert steps[0]["objective/judge_confidence"] == 1.0  # a callable judge is sure of every verdict it gives
    assert np.isfinite(last["loss"]) and 0 <= last["eval/win_rate"] <= 1

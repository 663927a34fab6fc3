"""python -m jodpo.evaluate: the win rate and its Wilson interval by hand; the LLM judge gives what the training run's
evaluation gives on the same completions; a reward model's verdicts are its scores compared by hand; a model against
itself wins half; an interrupted evaluation continues to the same files."""
import json
import math
import re
import subprocess

import jax
import numpy as np
import pytest

from jodpo import evaluate as E
from jodpo.program import loop
from jodpo.program import training_eval as evaluation
from jodpo.tasks import toy
from jodpo.program.checkpoint import restore_params
from jodpo.program.config import from_dict
from jodpo.program.run import build
from tests import hf_fixtures, subproc

JUDGE_PROMPT = "review {prompt} {response0} {response1} :"  # the tiny world's words; answers "good" / "bad"


class Killed(RuntimeError):
    pass


def test_win_rate_and_wilson_interval_by_hand():
    assert E.wilson_interval(7, 10) == pytest.approx((0.3968, 0.8922), abs=5e-5)  # the textbook 7 of 10
    p, n, z = 0.7, 10, 1.959964  # the formula, written out
    centre, half = (p + z * z / 20) / (1 + z * z / n), z * math.sqrt(p * 0.3 / n + z * z / 400) / (1 + z * z / n)
    assert E.wilson_interval(7, 10) == pytest.approx((centre - half, centre + half), abs=1e-6)
    assert E.wilson_interval(0, 5)[0] == 0.0 and E.wilson_interval(5, 5)[1] == 1.0
    # 6 wins, 2 ties (half a win each), 2 losses, 1 without a verdict: 7 of 10
    verdicts = ["win"] * 6 + ["tie", None, "loss", "tie", "loss"]
    s = E.summarize(verdicts)
    assert (s["wins"], s["ties"], s["losses"], s["no_verdict"], s["judged"]) == (6, 2, 2, 1, 10)
    assert s["win_rate"] == 0.7 and s["ci95"] == list(E.wilson_interval(7, 10))
    assert [E.verdict(p) for p in (0.9, 0.5, 0.1, math.nan)] == ["win", "tie", "loss", None]


def test_pointwise_means_and_intervals_by_hand():
    s = E.mean_summary([1.0, 0.0, 1.0, 1.0, None])  # 0/1 rewards: a proportion, Wilson's interval
    assert (s["mean"], s["n"], s["no_score"]) == (0.75, 4, 1) and s["ci95"] == list(E.wilson_interval(3, 4))
    assert s["interval"].startswith("Wilson")
    # two values 0 and 1 resampled: the mean is 0, 0.5 or 1 with chances 1/4, 1/2, 1/4, so its 2.5% and 97.5%
    # quantiles are 0 and 1; paired differences always get the bootstrap, even when they are 0 or 1
    d = E.mean_summary([0.0, 1.0], paired=True)
    assert d["mean"] == 0.5 and d["ci95"] == [0.0, 1.0] and d["interval"].startswith("percentile bootstrap")
    assert E.bootstrap_interval([0.3] * 5) == pytest.approx((0.3, 0.3), abs=1e-12)  # nothing varies
    assert all(math.isnan(v) for v in E.bootstrap_interval([]))
    # 400 values: the percentile bootstrap is the normal interval mean +- 1.96 sd / sqrt(n) (sd with 1/n, as the
    # bootstrap's), up to the Monte-Carlo error of 10,000 resamples (about 1.5% of the half-width)
    x = np.arange(400) % 7 * 0.5
    lo, hi = E.mean_summary(list(x))["ci95"]
    half = 1.959964 * x.std() / math.sqrt(400)
    assert lo == pytest.approx(x.mean() - half, abs=0.05 * half)
    assert hi == pytest.approx(x.mean() + half, abs=0.05 * half)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """16 of the tiny world's evaluation prompts with reference completions, some positive, some negative."""
    rng = np.random.default_rng(0)
    prompts = [json.loads(x)["prompt"] for x in (toy.world_dir() / "eval.jsonl").read_text().splitlines()][:16]
    rows = [{"prompt": p, "completion": " ".join(rng.choice(toy.POSITIVE if k % 2 else toy.NEGATIVE, 3))}
            for k, p in enumerate(prompts)]
    path = tmp_path_factory.mktemp("refs") / "refs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_llm_judge_gives_what_the_training_run_s_evaluation_gives(tiny_run, references, tmp_path, capsys):
    judge = str(toy.world_dir() / "model")  # the untrained tiny Llama, asked "good" or "bad"
    out = tmp_path / "eval"
    assert E.main([str(tiny_run), "--out", str(out), "--dataset_name", str(references), "--judge", judge,
                   "--judge_prompt", JUDGE_PROMPT, "--judge_answer_tokens", "('good', 'bad')"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "judged.jsonl").read_text().splitlines()]
    # the training run's evaluation, on its checkpoint 200, with this judge and these references
    saved = json.loads((tiny_run / "config.json").read_text())
    cfg = from_dict(saved | {"report_to": "none", "reward_funcs": [], "judge": judge, "judge_prompt": JUDGE_PROMPT,
                             "judge_answer_tokens": ["good", "bad"], "eval_dataset": str(references),
                             "max_eval_prompts": 16, "output_dir": str(tmp_path / "run")})
    run = build(cfg)
    state = loop.initial_state(run)
    state = state.replace(params=jax.device_put(restore_params(tiny_run / "checkpoints" / "200"),
                                                jax.tree.map(lambda x: x.sharding, state.params)))
    sampled = [t for _, _, _, s in evaluation.eval_samples(run, state) for t in run.decode(np.asarray(s.tokens)[0])]
    assert [r["completion"] for r in rows] == sampled  # the same completions
    in_run = evaluation.evaluate(run, state)["eval/win_rate"]
    assert summary["win_rate"] == in_run and 0 < in_run < 1  # the same verdicts
    p_reference = evaluation.judge_against(run.judge, [r["prompt"] for r in rows], [r["baseline"] for r in rows],
                                           [r["completion"] for r in rows])
    # the command judges a batch at a time, this all 16 at once: other programs, whose float32 logit differences may
    # differ by a few ulps of the logits (about 1 for this untrained judge; 16 bounds them); a sigmoid of them by 1/4
    np.testing.assert_allclose([r["probability"] for r in rows], 1 - p_reference, rtol=0,
                               atol=8 * np.finfo(np.float32).eps * 16 / 4)
    assert summary["baseline"] == "the dataset's reference completions" and summary["judged"] == 16
    lo, hi = summary["ci95"]
    assert f"win rate {in_run:.3f}" in printed and f"95% confidence interval (Wilson score): [{lo:.3f}, {hi:.3f}]" \
        in printed
    words = np.mean([len(r["completion"].split()) for r in rows])  # the tiny world's words are its tokens
    assert re.search(rf"mean length: model \d+\.\d tokens, {words:.1f} words; baseline 3.0 tokens, 3.0 words", printed)


def test_reward_model_verdicts_are_its_scores_compared(checkpoints, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = hf_fixtures.prompt_dataset(tmp_path / "data") / "test.jsonl"
    rm = checkpoints["llama"]["reward"]
    out = tmp_path / "eval"
    assert E.main([str(checkpoints["llama"]["causal_lm"]), "--out", str(out), "--dataset_name", str(data),
                   "--reward_model_path", str(rm), "--max_new_tokens", "4", "--max_prompt_length", "64",
                   "--bf16", "False", "--per_device_eval_batch_size", "4"]) == 0
    rows = [json.loads(x) for x in (out / "judged.jsonl").read_text().splitlines()]
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(rm)

    def score(prompt, completion):  # the reward model reads the prompt and the completion as one text
        ids = tok(prompt + completion, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])

    for r in rows:
        s, b = score(r["prompt"], r["completion"]), score(r["prompt"], r["baseline"])
        assert r["score"] == pytest.approx(s, abs=1e-4) and r["baseline_score"] == pytest.approx(b, abs=1e-4)
        assert r["verdict"] == ("win" if r["score"] > r["baseline_score"] else "loss")
        assert r["probability"] == pytest.approx(1 / (1 + math.exp(b - s)), abs=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    wins = sum(r["verdict"] == "win" for r in rows)
    assert summary["win_rate"] == wins / 8 and summary["ci95"] == list(E.wilson_interval(wins, 8))


SELF = ["--reward_funcs", "jodpo.tasks.toy:sentiment_reward", "--bf16", "False", "--max_new_tokens", "12",
        "--temperature", "1.0", "--seed", "0", "--per_device_eval_batch_size", "16"]


@pytest.fixture(scope="module")
def against_itself(tmp_path_factory):
    """The untrained tiny policy against itself (drawn with another seed), on the 64 evaluation prompts."""
    model = str(toy.world_dir() / "model")
    out = tmp_path_factory.mktemp("self") / "eval"
    args = [model, "--dataset_name", str(toy.world_dir() / "eval.jsonl"), "--baseline", model, *SELF]
    assert E.main([*args, "--out", str(out), "--baseline_seed", "1"]) == 0
    return args, out


def test_a_model_against_itself_wins_half(against_itself, tmp_path):
    args, out = against_itself
    s = json.loads((out / "summary.json").read_text())
    assert s["prompts"] == 64 and s["ties"] < 32 and s["ci95"][0] < 0.5 < s["ci95"][1]
    assert abs(s["mean_tokens"]["model"] - s["mean_tokens"]["baseline"]) < 2
    same = tmp_path / "same"  # the same seed: the same completions, every pair a tie
    assert E.main([*args, "--out", str(same)]) == 0
    s = json.loads((same / "summary.json").read_text())
    assert s["ties"] == 64 and s["win_rate"] == 0.5


def positive(prompts, completions, **_):
    """A 0/1 reward: the completion's sentiment is above 0."""
    return [float(r > 0) for r in toy.sentiment_reward(prompts, completions)]


def test_pointwise_scores_are_the_rewards_and_their_paired_difference(against_itself, tmp_path, capsys):
    """The same completions as the win-rate evaluation (its files are continued, not drawn again), each scored
    alone: the mean, the baseline's mean and the mean of the paired differences are those of the rewards by hand."""
    import shutil

    args, judged = against_itself
    out = tmp_path / "pointwise"
    shutil.copytree(judged, out)
    assert E.main([*args, "--out", str(out), "--baseline_seed", "1", "--pointwise"]) == 0
    assert (out / "completions.jsonl").read_bytes() == (judged / "completions.jsonl").read_bytes()
    rows = [json.loads(x) for x in (out / "scored.jsonl").read_text().splitlines()]
    pairs = [json.loads(x) for x in (judged / "judged.jsonl").read_text().splitlines()]
    score = toy.sentiment_reward(None, [r["completion"] for r in rows])
    base = toy.sentiment_reward(None, [r["baseline"] for r in rows])
    assert [r["score"] for r in rows] == pytest.approx(score) == [p["score"] for p in pairs]
    assert [r["baseline_score"] for r in rows] == pytest.approx(base) == [p["baseline_score"] for p in pairs]
    s = json.loads((out / "summary.json").read_text())
    diff = np.asarray(score) - np.asarray(base)
    tol = 1e-6  # the rewards pass through float32, as in training (values in [-1, 1]: float32's 6e-8 and sums)
    assert s["n"] == s["difference"]["n"] == 64 and s["mean"] == pytest.approx(np.mean(score), abs=tol)
    assert s["baseline_scores"]["mean"] == pytest.approx(np.mean(base), abs=tol)
    assert s["difference"]["mean"] == pytest.approx(diff.mean(), abs=tol)
    assert s["difference"]["ci95"] == pytest.approx(E.bootstrap_interval(diff), abs=tol)
    assert s["difference"]["ci95"][0] < 0 < s["difference"]["ci95"][1]  # a model against itself: no difference
    assert "paired difference (model - baseline)" in capsys.readouterr().out
    # a 0/1 reward, no baseline: the rate of positive completions, with Wilson's interval
    i = args.index("--reward_funcs")
    rate = tmp_path / "rate"
    shutil.copytree(judged, rate)
    assert E.main([*args[:i], *args[i + 2:], "--out", str(rate), "--baseline_seed", "1", "--pointwise",
                   "--reward_funcs", "tests.test_evaluate:positive"]) == 0
    s = json.loads((rate / "summary.json").read_text())
    k = sum(v > 0 for v in score)
    assert (s["mean"], s["n"], s["ci95"]) == (k / 64, 64, list(E.wilson_interval(k, 64)))
    assert E.main([*args[:i], *args[i + 2:], "--out", str(tmp_path / "j"), "--pointwise", "--judge",
                   "tests.test_evaluate:sentiment_judge"]) == 2
    assert "--pointwise scores each completion by rewards" in capsys.readouterr().err


def sentiment_judge(prompts, pairs):
    """A callable pairwise judge (TRL's shape): the more positive completion wins; equal ones get no verdict."""
    out = []
    for a, b in pairs:
        sa, sb = toy.sentiment_reward(None, [a, b])
        out.append(0 if sa > sb else 1 if sb > sa else -1)
    return out


def test_a_callable_judge_gives_the_verdicts_of_its_function(against_itself, tmp_path):
    args, by_reward = against_itself
    out = tmp_path / "judged"
    i = args.index("--reward_funcs")
    assert E.main([*args[:i], *args[i + 2:], "--out", str(out), "--baseline_seed", "1", "--judge",
                   "tests.test_evaluate:sentiment_judge"]) == 0
    rows = [json.loads(x) for x in (out / "judged.jsonl").read_text().splitlines()]
    expected = [json.loads(x) for x in (by_reward / "judged.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in rows] == [None if e["verdict"] == "tie" else e["verdict"] for e in expected]
    assert [r["probability"] for r in rows] == [{"win": 1.0, "loss": 0.0}.get(r["verdict"]) for r in rows]
    s = json.loads((out / "summary.json").read_text())
    assert s["no_verdict"] == sum(e["verdict"] == "tie" for e in expected) and s["ties"] == 0
    assert s["comparison"] == "judge tests.test_evaluate:sentiment_judge"


def test_an_interrupted_evaluation_continues_to_the_same_files(against_itself, tmp_path, monkeypatch):
    args, full = against_itself
    out = tmp_path / "eval"
    real, calls = E.Comparison.rows, []

    def interrupted(self, prompts, *rest):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise Killed  # killed while judging the second batch
        return real(self, prompts, *rest)

    monkeypatch.setattr(E.Comparison, "rows", interrupted)
    with pytest.raises(Killed):
        E.main([*args, "--out", str(out), "--baseline_seed", "1"])
    assert len((out / "judged.jsonl").read_text().splitlines()) == 16 and not (out / "summary.json").exists()
    monkeypatch.setattr(E.Comparison, "rows", real)
    assert E.main([*args, "--out", str(out), "--baseline_seed", "1"]) == 0
    for name in ("completions.jsonl", "baseline.jsonl", "judged.jsonl"):
        assert (out / name).read_bytes() == (full / name).read_bytes(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads((full / "summary.json").read_text())


def test_errors_are_one_line_and_exit_status_2(tmp_path, capsys):
    model = str(toy.world_dir() / "model")
    args = [model, "--out", str(tmp_path / "e"), "--dataset_name", str(toy.world_dir() / "eval.jsonl"),
            "--max_prompts", "8", "--bf16", "False"]
    python, env = subproc.without_torch(subproc.env())
    p = subprocess.run([*python, "-m", "jodpo.evaluate", *args], capture_output=True, text=True, env=env,
                       cwd=subproc.ROOT)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "jodpo.evaluate: error: the dataset has no 'completion' column to compare with; give one (reference "
        "completions), or --baseline MODEL to compare with a second model's completions"), p.stderr
    cases = [(["--baseline", model], "nothing to compare with: give --judge (an LLM, or module:function), "
                                     "--reward_model_path or --reward_funcs"),
             (["--baseline", model, "--judge", "no_such_module:judge"],
              "judge 'no_such_module:judge' cannot be imported: No module named 'no_such_module'"),
             (["--baseline", model, "--judge", str(tmp_path / "no_judge")], "no_judge: not a model directory"),
             (["--baseline", model, "--reward_funcs", "jodpo.tasks.toy:no_reward"],
              "reward function 'jodpo.tasks.toy:no_reward' cannot be imported")]
    for extra, message in cases:
        capsys.readouterr()
        assert E.main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("jodpo.evaluate: error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "e").exists()  # checked before anything is generated

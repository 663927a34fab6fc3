"""TRL 1.12's Nash-MD and XPO front doors: TRL's quick starts (with the reward model of TRL's "Use a reward model"
tip), their imports changed to jodpo, run on tiny local stand-ins and log what the command line logs for the same
config, under every metric name TRL 1.12 logs; the settings' checks and per-epoch schedules. The numbers themselves
are TRL 1.12's (tests/test_trl112.py); resume and sharding of these steps: tests/test_sharding.py."""
import json
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import jodpo
from jodpo import train
from jodpo import train_step as ts
from jodpo.errors import ConfigError
from tests import hf_fixtures, subproc

# TRL 1.12's quick start (docs: Nash-MD Trainer, with the reward-model tip), `trl.experimental.nash_md` -> `jodpo`
EXAMPLE = """
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from jodpo import {name}Config, {name}Trainer

model = AutoModelForCausalLM.from_pretrained(MODEL)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
reward_model = AutoModelForSequenceClassification.from_pretrained(REWARD, num_labels=1)
train_dataset = Dataset.from_list(ROWS)  # load_dataset("trl-lib/ultrafeedback-prompt", split="train") in TRL's

training_args = {name}Config(output_dir=OUT, **TINY)
trainer = {name}Trainer(
    model=model, reward_funcs=reward_model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset
)
trainer.train()
"""

TINY = dict(max_steps=2, per_device_train_batch_size=2, max_new_tokens=4, max_length=96, max_prompt_length=64,
            prompt_buckets=[64], logging_steps=1, bf16=False, report_to="none", seed=3, learning_rate=1e-3,
            missing_eos_penalty=1.0)
GOLDEN = Path(__file__).resolve().parent / "golden"
LOGGED_ELSEWHERE = {"loss", "grad_norm", "learning_rate", "epoch", "step"}  # TRL's Trainer's, not the method's


@pytest.mark.parametrize("name,method,own", [("NashMD", "nash_md", dict(mixture_coef=[0.25])),
                                             ("XPO", "xpo", dict(alpha=[0.05], loss_type="ipo"))])
def test_trls_quick_start_with_its_import_changed_logs_what_the_command_line_logs(checkpoints, tmp_path, name,
                                                                                  method, own):
    data = hf_fixtures.prompt_dataset(tmp_path / "data", chat=True)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    model, reward = (str(checkpoints["qwen2"][k]) for k in ("causal_lm", "reward"))
    scope = dict(MODEL=model, REWARD=reward, ROWS=rows, OUT=str(tmp_path / "api"), TINY=TINY | own)
    exec(compile(textwrap.dedent(EXAMPLE.format(name=name)), "trl_example.py", "exec"), scope)
    args = scope["trainer"].args
    assert args.method == method and isinstance(args, getattr(jodpo, f"{name}Config"))
    assert getattr(args, next(iter(own))) == own[next(iter(own))][0]  # a one-element list is a float, as TRL's

    cli = ["--model_name_or_path", model, "--reward_model_path", reward, "--dataset_name", str(data / "train.jsonl"),
           "--output_dir", str(tmp_path / "cli"), "--prompt_buckets", "64", "--method", method,
           *[f"--config.{k}={v!r}" for k, v in (TINY | own).items() if k != "prompt_buckets"]]
    assert train.main(cli) == 0  # a second run in the same process
    api, command = subproc.metrics_lines(tmp_path / "api"), subproc.metrics_lines(tmp_path / "cli")
    assert [m["step"] for m in api] == [1, 2] and api == command
    trl = {k for p in GOLDEN.glob(f"trl112_{method}_*.json") for k in json.loads(p.read_text())["log"]}
    assert trl - LOGGED_ELSEWHERE and trl - LOGGED_ELSEWHERE <= set(api[-1]), trl - set(api[-1])
    assert all(np.isfinite(v) for v in api[-1].values() if isinstance(v, float))


def test_settings_of_another_method_and_shapes_the_pair_cannot_take_are_refused_in_one_line():
    assert jodpo.NashMDConfig("x", mixture_coef=[0.5, 0.2]).mixture_coef == (0.5, 0.2)
    assert jodpo.XPOConfig("x").alpha == 1e-5 and jodpo.XPOConfig("x").method == "xpo"
    assert jodpo.XPOConfig("x").replace(beta=0.2).method == "xpo"
    for make, phrase in [
            (lambda: jodpo.NashMDConfig("x", alpha=0.1), "alpha is xpo's setting and method is 'nash_md'"),
            (lambda: jodpo.OnlineDPOConfig("x", mixture_coef=0.2), "mixture_coef is nash_md's setting"),
            (lambda: jodpo.NashMDConfig("x", mixture_coef=1.5), r"mixture_coef .* must be in \[0, 1\]"),
            (lambda: jodpo.XPOConfig("x", method="nash_md"), "this config is method='xpo'"),
            (lambda: jodpo.XPOConfig("x", num_generations=4, sync_steps=2),
             "num_generations=4, sync_steps=2 asks otherwise: leave num_generations, sync_steps at the default"),
            (lambda: jodpo.XPOConfig("x", loss_type="simpo"), "loss_type='simpo' has none"),
            (lambda: jodpo.NashMDConfig("x", loss_type="ipo"), "trains with its own loss"),
            (lambda: jodpo.TrainConfig(method="kto"), "unknown method 'kto'"),
            (lambda: jodpo.NashMDTrainer(args=jodpo.OnlineDPOConfig("x")), "give a jodpo.NashMDConfig"),
            (lambda: jodpo.XPOTrainer(args=jodpo.NashMDConfig("x")), "give a jodpo.XPOConfig")]:
        with pytest.raises(ConfigError, match=phrase):
            make()
    # the functional API's StepConfig runs the same check (jodpo.methods.check_method), as ValueError
    model, sampling = None, jodpo.SamplingConfig(max_new_tokens=2)  # the checks read no architecture
    for kw, phrase in [(dict(method="xpo", pairing="best_worst"), "pairing='best_worst' asks otherwise"),
                       (dict(method="online_dpo", alpha=(0.1,)), "alpha is xpo's setting"),
                       (dict(method="xpo", loss_type="simpo"), "loss_type='simpo' has none")]:
        with pytest.raises(ValueError, match=phrase):
            ts.StepConfig(model=model, sampling=sampling, optimizer=ts.OptimizerConfig(), **kw)
    assert ts.StepConfig(model=model, sampling=sampling, optimizer=ts.OptimizerConfig(), method="xpo",
                         pairing="random", alpha=[0.1, 0.2]).alpha == (0.1, 0.2)


def test_per_epoch_lists_are_indexed_by_the_whole_epoch_and_keep_the_last():
    """TRL's lists per epoch (beta, alpha, mixture_coef): ``values[min(int(epoch), len - 1)]`` (TRL 1.12 indexes
    them with the float epoch and fails for two or more)."""
    cfg = types.SimpleNamespace(updates_per_epoch=3)
    got = [float(ts.scheduled(cfg, (0.5, 0.2, 0.1), step)) for step in range(11)]
    assert got == pytest.approx([0.5] * 3 + [0.2] * 3 + [0.1] * 5)


def test_a_judges_verdicts_are_nash_mds_probability_and_pick_xpos_pair(neox):
    """With a judge (jodpo's, beyond TRL 1.12's rewards): Nash-MD's P is the judge's probability that the policy's
    completion is better, XPO's pair is ordered by the verdict, and a pair without a verdict weighs nothing."""
    import jax
    import jax.numpy as jnp

    from jodpo import judges, losses

    model, params = neox
    ref = jax.tree.map(lambda x: x * 1.02, params)
    rng = np.random.default_rng(0)
    B, P, C = 2, 5, 4
    prompt = jnp.asarray(rng.integers(3, model.vocab_size, (B, P)), jnp.int32)
    comp = jnp.asarray(rng.integers(3, model.vocab_size, (2 * B, C)), jnp.int32)
    pmask, cmask = jnp.ones((B, P), jnp.int32), jnp.ones((2 * B, C), jnp.int32).at[1, 3].set(0)
    verdicts = jnp.asarray(judges.pair_scores(np.array([0.8, np.nan])))  # pair 1: no verdict
    logp = losses.completion_logprobs(model, params, prompt, pmask, comp, cmask)
    ref_logp = losses.completion_logprobs(model, ref, prompt, pmask, comp, cmask)
    S, R, beta, alpha = logp.sum(-1), ref_logp.sum(-1), 0.2, 0.03

    value, m = jodpo.nash_md_loss(model, params, ref, prompt, pmask, comp, cmask, verdicts, beta=beta, judged=True)
    want = beta * ((logp - ref_logp) * logp)[0].sum() - (0.8 - 0.5) * S[0]
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    assert float(m["rewards/probabilities"]) == pytest.approx(0.8) and float(m["objective/judge_abstained"]) == 0.5
    assert "rewards/chosen" not in m

    value, m = jodpo.xpo_loss(model, params, ref, prompt, pmask, comp, cmask, verdicts, beta=beta, alpha=alpha,
                              judged=True)
    margin = (S[0] - R[0]) - (S[B] - R[B])  # the policy's completion chosen (0.8 >= 0.2)
    want = -jax.nn.log_sigmoid(beta * margin) + alpha * S[B]
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    assert float(m["loss/xpo"]) == pytest.approx(float(alpha * S[B]), rel=1e-5)
    assert "objective/model_scores" not in m and float(m["objective/judge_abstained"]) == 0.5

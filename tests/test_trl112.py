"""jodpo's Nash-MD and XPO against TRL 1.12 (their last release), from golden numbers recorded in TRL 1.12's own
environment (tests/golden/trl112_*.json; ``bash scripts/record_trl112.sh`` regenerates them): one step of each
trainer on the golden models (tests/trl112_fixtures.py, built here as there), replayed through jodpo with the tokens
TRL sampled: the tokenized prompts, the rewards, the per-token log-probs, the loss, the gradient (its norm and every
parameter's), every metric TRL logs; and TRL's GeometricMixtureWrapper decoding greedily against ``sample_pair``.
float32, rtol 1e-4."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from datasets import Dataset

import jodpo
import jodpo.methods
from jodpo import losses, sampling
from jodpo import train_step as ts
from jodpo.models.export import hf_tensors
from jodpo.program import data as D
from tests import trl112_fixtures as F

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = sorted(p.stem[len("trl112_"):] for p in GOLDEN.glob("trl112_*.json") if p.stem != "trl112_mixture_greedy")
RTOL, ATOL = 1e-4, 1e-5
# TRL's log entries that are not the step's metrics (loss: the log rounds it to 4 places; the unrounded is recorded)
NOT_METRICS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}
# checkpoint names (what jodpo writes) whose module transformers 5 calls otherwise (named_parameters, the recording)
ALIASES = {"embed_out.weight": "lm_head.weight"}


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    """The golden models of a family, built on first use (as scripts/record_trl112.py built them)."""
    root, built = tmp_path_factory.mktemp("trl112"), {}

    def get(family: str, fingerprints: dict) -> dict:
        if family not in built:
            built[family] = F.build(root, family)
        for name, value in fingerprints.items():
            assert F.fingerprint(built[family][name]) == pytest.approx(value, rel=1e-12), (
                f"the golden {family} {name} is not the model TRL 1.12 was recorded on (tests/trl112_fixtures.py or "
                "its inputs changed): rerun bash scripts/record_trl112.sh")
        return built[family]

    return get


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / f"trl112_{name}.json").read_text())


def test_golden_cases_cover_both_trainers():
    assert {_golden(c)["trainer"] for c in CASES} == {"nash_md", "xpo"}
    assert all(_golden(c)["versions"]["trl"] == "1.12.0" for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_one_step_equals_trl_112(golden_models, case):
    rec = _golden(case)
    paths = golden_models(rec["family"], rec["fingerprints"])
    model, params = jodpo.load_model(str(paths["policy"]))
    _, ref_params = jodpo.load_model(str(paths["reference"]))
    rm, rm_params = jodpo.load_model(str(paths["reward"]), task="reward")
    tok = jodpo.load_tokenizer(str(paths["policy"]))
    P, PM = (np.asarray(rec[k], np.int32) for k in ("prompt_ids", "prompt_mask"))
    C = np.concatenate([np.asarray(rec["policy_ids"], np.int32), np.asarray(rec["second_ids"], np.int32)])
    CM = np.concatenate([np.asarray(rec["policy_mask"], np.int32), np.asarray(rec["second_mask"], np.int32)])
    B, settings = len(P), rec["settings"]

    # The prompts as jodpo's data pipeline tokenizes them for these trainers: TRL's ids, BOS first.
    method = jodpo.methods.METHODS[rec["trainer"]]
    data = D.prepare_prompts(Dataset.from_dict({"prompt": rec["prompts"]}), tok, 512,
                             tok.bos_token_id if method.prompt_bos else None)
    assert [row.tolist() for row in data.ids] == [[int(i) for i, m in zip(r, k) if m] for r, k in zip(P, PM)]
    assert all(row[0] == rec["bos_token_id"] for row in data.ids)

    cfg = ts.StepConfig(
        model=model, sampling=jodpo.SamplingConfig(max_new_tokens=rec["max_new_tokens"],
                                                   eos_token_ids=(rec["eos_token_id"],),
                                                   pad_token_id=rec["pad_token_id"]),
        optimizer=ts.OptimizerConfig(learning_rate=rec["learning_rate"], total_steps=1), beta=settings["beta"],
        method=rec["trainer"], alpha=settings.get("alpha", 1e-5), mixture_coef=settings.get("mixture_coef", 0.5),
        loss_type=settings.get("loss_type", "sigmoid"), missing_eos_penalty=settings["missing_eos_penalty"],
        reward_model=rm)
    samples = jodpo.Samples(tokens=C[None], mask=CM[None], logprobs=np.zeros(C.shape, np.float32)[None])

    # Rewards: the reward model reads the token ids as TRL 1.12's get_reward does (the EOS included), then the
    # EOS penalty (TRL's scores are after it; both kinds of completion are in the batch).
    raw = np.asarray(ts.jit_score_completions(cfg, rm_params, P[None], PM[None], samples))[0]
    scores, has_eos = cfg.loss.scores(jnp.asarray(raw), C, CM)
    assert 0 < int(has_eos.sum()) < 2 * B
    want = np.concatenate(rec["scores"])
    np.testing.assert_allclose(np.asarray(scores), want, rtol=RTOL, atol=ATOL * np.abs(want).max())

    # Per-token log-probs (TRL's are masked to the completion), each as TRL's trainer reads them.
    logp = {name: np.asarray(losses.completion_logprobs(model, p, P, PM, C, CM))
            for name, p in (("policy", params), ("reference", ref_params))}
    blocks = {"nash_md": [("policy", 0), ("reference", 0)],
              "xpo": [("policy", 0), ("policy", 1), ("reference", 1), ("reference", 0)]}[rec["trainer"]]
    for (model_name, block), theirs in zip(blocks, rec["logprobs"]):
        np.testing.assert_allclose(logp[model_name][block * B:(block + 1) * B], np.asarray(theirs), rtol=RTOL,
                                   atol=ATOL, err_msg=f"{model_name} on block {block}")

    # The step: jodpo's update from TRL's samples and raw rewards (the method's loss, its coefficients).
    state = ts.init_state(cfg, params, jax.random.key(0))
    _, metrics = ts.jit_update(cfg, state, ref_params, P[None], PM[None], samples, jnp.asarray(raw)[None])
    metrics = {k: float(v) for k, v in metrics.items()}
    log = rec["log"]
    np.testing.assert_allclose(metrics["loss"], rec["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["grad_norm"], log["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose(metrics["learning_rate"], log["learning_rate"], rtol=1e-6)
    for name in sorted(set(log) - NOT_METRICS):
        np.testing.assert_allclose(metrics[name], log[name], rtol=RTOL, atol=ATOL, err_msg=name)

    # Every parameter's gradient norm, under transformers' names.
    batch = losses.OnlineBatch(jnp.asarray(P), jnp.asarray(PM), jnp.asarray(C), jnp.asarray(CM), jnp.asarray(raw))
    grads = jax.jit(jax.grad(lambda p: method.loss(model, p, ref_params, batch, ts.coefficients(cfg, 0),
                                                   cfg.loss)[0]))(params)
    norms = {ALIASES.get(name, name): float(np.linalg.norm(g)) for name, g in hf_tensors(model, grads)}
    assert set(rec["grad_norms"]) <= set(norms), set(rec["grad_norms"]) - set(norms)
    scale = max(rec["grad_norms"].values())
    for name, value in rec["grad_norms"].items():
        np.testing.assert_allclose(norms[name], value, rtol=RTOL, atol=ATOL * scale, err_msg=name)


@pytest.mark.parametrize("family", F.FAMILIES)
def test_greedy_mixture_equals_trl_geometric_mixture_wrapper(golden_models, family):
    """TRL 1.12's GeometricMixtureWrapper generating greedily (full forwards of both models at every step) against
    ``sample_pair``'s mixture block (one decode loop over two caches); the argmaxes were clear of ties by at least
    the recorded gap."""
    rec = _golden("mixture_greedy")[family]
    assert rec["min_gap"] > 1e-3
    paths = golden_models(family, rec["fingerprints"])
    model, params = jodpo.load_model(str(paths["policy"]))
    _, ref_params = jodpo.load_model(str(paths["reference"]))
    ids, mask = np.asarray(rec["prompt_ids"], np.int32), np.asarray(rec["prompt_mask"], np.int32)
    T = 8
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.0, eos_token_ids=(model.eos_token_ids[0],),
                               pad_token_id=model.pad_token_id)
    out = jax.jit(sampling.sample_pair, static_argnums=(0, 6))(model, params, ref_params, ids, mask,
                                                               jax.random.key(0), cfg, rec["mixture_coef"])
    theirs = np.asarray(rec["tokens"])
    theirs = np.pad(theirs, ((0, 0), (0, T - theirs.shape[1])), constant_values=model.pad_token_id)
    np.testing.assert_array_equal(np.asarray(out.tokens)[len(ids):], theirs)
    # jodpo.GeometricMixtureWrapper, TRL's class, generating as transformers' generate does through TRL's
    from transformers import GenerationConfig

    wrapper = jodpo.GeometricMixtureWrapper((model, params), (model, ref_params), GenerationConfig(
        max_new_tokens=T, do_sample=False, eos_token_id=model.eos_token_ids[0], pad_token_id=model.pad_token_id),
        mixture_coef=rec["mixture_coef"])
    np.testing.assert_array_equal(wrapper.generate(ids, mask)[:, ids.shape[1]:], theirs)

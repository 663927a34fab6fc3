"""The precision policy (``Model.precision``, ``matmul_precision``): every dot of the models, the sampler, the
scorers, the losses and the whole step carries it, and float32 means float32 against a float64 reference.

On a CPU float32 dots are float32 whatever they carry, so the numbers alone cannot catch a dot that ignores
the policy there: the jaxpr and HLO checks do. With a GPU as jax's default backend (TF32 by default) the
float64 comparison catches it too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo.errors import ConfigError
from jodpo import train_step
from jodpo.program.config import TrainConfig
from jodpo.models import decoder
from tests import hf_fixtures


def _dots(jaxpr) -> list:
    """Every dot_general equation of a (closed) jaxpr, inside scans, loops, conds, remat and jits too."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += _dots(sub)
    return found


def _precisions(fn, *args) -> set:
    """{(operand dtypes, precision)} over the dots of ``fn(*args)``."""
    out = set()
    for eqn in _dots(jax.make_jaxpr(fn)(*args)):
        dtypes = tuple(str(v.aval.dtype) for v in eqn.invars)
        out.add((dtypes, eqn.params["precision"]))
    return out


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
HIGH = (jax.lax.Precision.HIGH, jax.lax.Precision.HIGH)


def _pair(checkpoints, family):
    model, params = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    rm, rm_params = jodpo.load_model(str(checkpoints[family]["reward"]), task="reward")
    return model, params, rm, rm_params


@pytest.fixture(scope="module")
def llama(checkpoints):
    return _pair(checkpoints, "llama")


def _step_fns(model, params, rm, rm_params):
    """(name, fn, args) of every device computation a run makes, with ``model``'s precision."""
    rng = np.random.default_rng(0)
    ids, mask = hf_fixtures.padded_batch(rng, [5, 3], model.pad_token_id, "left")
    comp, cmask = hf_fixtures.padded_batch(rng, [4, 2, 3, 4], model.pad_token_id, "right")
    cfg = train_step.StepConfig(model=model, sampling=jodpo.SamplingConfig(max_new_tokens=3, eos_token_ids=(0,)),
                                optimizer=train_step.OptimizerConfig(learning_rate=1e-3), reward_model=rm)
    state = train_step.init_state(cfg, params, jax.random.key(0))
    grad = jax.grad(lambda p: jodpo.online_dpo_loss(model, p, params, ids, mask, comp, cmask, jnp.arange(4.0),
                                                    beta=0.1)[0])
    return [
        ("logits", lambda p: jodpo.logits(model, p, ids, mask), (params,)),
        ("reward_scores", lambda p: jodpo.reward_scores(rm, p, ids, mask), (rm_params,)),
        ("sample", lambda p: jodpo.sample(model, p, ids, mask, jax.random.key(1), cfg.sampling, num_samples=2),
         (params,)),
        ("completion_logprobs", lambda p: jodpo.completion_logprobs(model, p, ids, mask, comp, cmask), (params,)),
        ("online_dpo_loss grad", grad, (params,)),
        ("online_step", lambda s: train_step.online_step(cfg, s, params, rm_params, ids[None], mask[None]), (state,)),
    ]


@pytest.mark.parametrize("precision,expected", [("highest", HIGHEST), ("high", HIGH), ("tensorfloat32", HIGH)])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # Qwen3.5: the delta rule's float32 state dots too
def test_every_float32_dot_carries_the_policy(checkpoints, llama, family, precision, expected):
    model, params, rm, rm_params = llama if family == "llama" else _pair(checkpoints, family)
    model, rm = model.replace(precision=precision), rm.replace(precision=precision)
    for name, fn, args in _step_fns(model, params, rm, rm_params):
        found = _precisions(fn, *args)
        assert found, name
        assert {p for _, p in found} == {expected}, (name, found)


def test_bfloat16_compute_keeps_the_fast_path(llama):
    """bf16 operands are exact in any mode: their dots carry no precision, so the backend's fastest kernels run."""
    model, params, rm, rm_params = llama
    model, rm = model.replace(dtype="bfloat16"), rm.replace(dtype="bfloat16")
    for name, fn, args in _step_fns(model, params, rm, rm_params)[:4]:  # the forward computations
        found = _precisions(fn, *args)
        assert found and all(set(d) == {"bfloat16"} and p is None for d, p in found), (name, found)


def test_the_compiled_program_carries_the_policy(llama):
    model, params, _, _ = llama
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [5, 3], model.pad_token_id, "left")
    text = jax.jit(jodpo.logits, static_argnums=0).lower(model, params, ids, mask).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("HIGHEST" in line for line in dots), [d for d in dots if "HIGHEST" not in d][:2]


@pytest.mark.parametrize("family", ["neox", "llama", "qwen2"])
def test_float32_logits_equal_a_float64_reference(checkpoints, family):
    """At the default policy, jodpo's float32 forward (on jax's default backend) is float32-accurate: 1e-5 of the
    logits' scale from transformers computing in float64. TF32 would be about 1e-3 away."""
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(3), [12, 7, 9], model.pad_token_id, "right")
    ours = np.asarray(jax.jit(jodpo.logits, static_argnums=0)(model, params, ids, mask))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0), dtype=torch.long)).logits.numpy()
    real = mask.astype(bool)
    scale = np.abs(ref[real]).max()
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=1e-5 * scale)


def test_precision_is_checked_and_configured(checkpoints):
    with pytest.raises(ValueError, match="precision must be one of"):
        jodpo.load_model(str(checkpoints["llama"]["causal_lm"]), precision="float64")
    with pytest.raises(ConfigError, match="matmul_precision must be one of"):
        TrainConfig(matmul_precision="tf32")
    model, _ = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]), precision="high")
    assert model.precision == "high" and TrainConfig().matmul_precision == "highest"
    assert model != model.replace(precision="highest")  # a different compiled program: part of the jit cache key
    assert decoder.PRECISIONS[0] == "highest"

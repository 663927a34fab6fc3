"""Checks that mean something only with a GPU as jax's default backend (skipped elsewhere; ``--gpu-tests-on-cpu``
runs them on the CPU to check the tests themselves): precision, a 1B-shaped export, determinism, bf16 paths.

Run on a GPU machine with ``bash scripts/test.sh -m gpu`` (docs/gpu.md, "Running the suite on a GPU")."""
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import train_step
from jodpo.program.checkpoint import restore_params
from jodpo.models.export import save_hf, verify_export
from jodpo.models.loading import model_from_dir
from tests import hf_fixtures, subproc

pytestmark = pytest.mark.gpu
ON_GPU = jax.default_backend() == "gpu"


def test_the_precision_policy_is_what_makes_float32_float32(checkpoints):
    """On a GPU, "highest" stays float32-accurate where "default" (TF32) is visibly not: the policy is what does
    it. (On a CPU both are float32, so only the first half holds.)"""
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [40, 33], model.pad_token_id, "left")
    run = jax.jit(jodpo.logits, static_argnums=0)
    with jax.default_device(jax.devices("cpu")[0]):
        ref = np.asarray(run(model, jax.device_put(params, jax.devices("cpu")[0]), ids, mask))
    scale = np.abs(ref).max()
    err = {p: np.abs(np.asarray(run(model.replace(precision=p), params, ids, mask)) - ref).max() / scale
           for p in ("highest", "default")}
    assert err["highest"] < 1e-5, err
    if ON_GPU and jax.devices()[0].device_kind.lower().startswith(("nvidia a", "nvidia h", "nvidia b")):
        assert err["default"] > 1e-5, err  # TF32 (Ampere and later): the default would not be float32


def test_a_1b_shaped_export_verifies(tmp_path):
    """Pythia-1B's shape (random weights) on this backend: written, read back bitwise, and transformers' logits
    on the CPU equal jodpo's within 1e-4. On the CPU (--gpu-tests-on-cpu) a 1/16-wide shape stands in."""
    from transformers import GPTNeoXConfig

    wide = ON_GPU
    cfg = GPTNeoXConfig(hidden_size=2048 if wide else 128, num_hidden_layers=16 if wide else 2,
                        num_attention_heads=8 if wide else 2, intermediate_size=8192 if wide else 512,
                        vocab_size=50304 if wide else 1024, rotary_pct=0.25, eos_token_id=0, pad_token_id=1)
    cfg.save_pretrained(tmp_path / "source")
    model = model_from_dir(tmp_path / "source", "causal_lm", "float32")
    params = jodpo.init_params(model, jax.random.key(0))
    out = save_hf(model, params, tmp_path / "hf")
    checks = verify_export(model, params, out)
    assert "within" in checks[-1], checks


def _deterministic_env():
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "deterministic" not in f)
    return subproc.env(XLA_FLAGS=flags)  # the suite's own flag removed: the config field must do it


def _run(out, *extra, env=None):
    proc = subproc.start_tiny(out, *extra, environ=env)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]


def _killed_and_resumed(out, *extra, env=None):
    proc = subproc.start_tiny(out, "--config.save_steps=20", *extra, environ=env)
    subproc.wait_for(lambda: (out / "checkpoints" / "20").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _run(out, "--config.save_steps=20", *extra, env=env)


def _params(out):
    return [np.asarray(x) for x in jax.tree.leaves(restore_params(out / "checkpoints" / "200"))]


def test_deterministic_kill_and_resume_is_bitwise(tmp_path):
    env = _deterministic_env()
    _run(tmp_path / "whole", "--config.save_steps=20", "--config.deterministic=True", env=env)
    _killed_and_resumed(tmp_path / "resumed", "--config.deterministic=True", env=env)
    assert subproc.metrics_lines(tmp_path / "resumed") == subproc.metrics_lines(tmp_path / "whole")
    for a, b in zip(_params(tmp_path / "whole"), _params(tmp_path / "resumed")):
        np.testing.assert_array_equal(a, b)


def test_resume_without_determinism_is_as_close_as_two_runs(tmp_path):
    """The documented tolerance without ``deterministic``: a killed and resumed run is no further from the
    uninterrupted one than two uninterrupted runs are from each other (x4, and at least 1e-5 of the weights'
    scale), because resume restores the state bitwise and only the kernels' own non-determinism remains."""
    env = _deterministic_env()
    for name in ("a", "b"):
        _run(tmp_path / name, "--config.save_steps=20", env=env)
    _killed_and_resumed(tmp_path / "resumed", env=env)
    a, b, c = (_params(tmp_path / n) for n in ("a", "b", "resumed"))
    scale = max(np.abs(x).max() for x in a)

    def dist(x, y):
        return max(np.abs(p - q).max() for p, q in zip(x, y)) / scale

    assert dist(a, c) <= max(4 * dist(a, b), 1e-5), (dist(a, b), dist(a, c))


def test_bfloat16_paths_stay_close_to_float32(checkpoints):
    """bf16 compute (float32 master weights) on this backend: logits within bf16's resolution of the float32
    ones, and a whole bf16 online step that is finite and lands near the float32 step's loss."""
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    rm, rm_params = jodpo.load_model(str(checkpoints["llama"]["reward"]), task="reward")
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [9, 5, 7, 3], model.pad_token_id, "left")
    f32 = np.asarray(jodpo.logits(model, params, ids, mask))
    bf16 = np.asarray(jodpo.logits(model.replace(dtype="bfloat16"), params, ids, mask))
    real = mask.astype(bool)
    assert np.abs(bf16 - f32)[real].max() <= 0.05 * np.abs(f32[real]).max()  # a few bf16 ulps through 2 layers

    def step(dtype):
        m = model.replace(dtype=dtype)
        cfg = train_step.StepConfig(model=m, sampling=jodpo.SamplingConfig(max_new_tokens=6, temperature=0.0,
                                                                           eos_token_ids=(0,)),
                                    optimizer=train_step.OptimizerConfig(learning_rate=1e-3),
                                    reward_model=rm.replace(dtype=dtype))
        state = train_step.init_state(cfg, params, jax.random.key(0))
        _, metrics, _, _ = train_step.jit_online_step(cfg, state, params, rm_params, jnp.asarray(ids)[None],
                                                      jnp.asarray(mask)[None])
        return {k: float(v) for k, v in metrics.items()}

    a, b = step("float32"), step("bfloat16")
    assert all(np.isfinite(v) for v in b.values()), b
    assert b["skipped_update"] == 0 and abs(b["loss"] - a["loss"]) < 0.05, (a["loss"], b["loss"])


def test_cudnn_attention_equals_xla(checkpoints):
    """attn_implementation="cudnn" (cuDNN flash attention, bf16) gives the logits and the gradients of "xla" within
    bf16's resolution, on left-padded prompts, the shared-prompt forward and the sampler's prefill."""
    impl = "cudnn" if ON_GPU else "xla"  # --gpu-tests-on-cpu: checks the test itself, xla against xla
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    model = model.replace(dtype="bfloat16")
    rng = np.random.default_rng(0)
    ids, mask = hf_fixtures.padded_batch(rng, [40, 17, 33, 8], model.pad_token_id, "left")
    comp, cmask = hf_fixtures.padded_batch(rng, [9, 4, 12, 1, 5, 7, 12, 3], model.pad_token_id, "right")

    def outputs(m):
        lp = lambda p: jnp.sum(jodpo.completion_logprobs(m, p, ids, mask, comp, cmask))  # noqa: E731
        samples = jodpo.sample(m, params, ids, mask, jax.random.key(0),
                               jodpo.SamplingConfig(max_new_tokens=4, temperature=0.0, eos_token_ids=(0,)))
        return jodpo.logits(m, params, ids, mask), jax.grad(lp)(params), samples.logprobs[:, 0]  # the prefill's

    a, b = outputs(model), outputs(model.replace(attention=impl))
    real = mask.astype(bool)
    assert np.abs(np.asarray(a[0]) - np.asarray(b[0]))[real].max() <= 0.05 * np.abs(np.asarray(a[0])[real]).max()
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
        assert np.abs(np.asarray(x) - np.asarray(y)).max() <= 0.05 * (np.abs(np.asarray(x)).max() or 1.0)
    np.testing.assert_allclose(np.asarray(b[2]), np.asarray(a[2]), atol=0.1)

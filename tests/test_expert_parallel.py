"""The expert mesh axis on 8 fake CPU devices equals one device: the tiny Qwen3-MoE (4 experts, two a token) with its
experts split by expert over (data, expert) = (2, 4) and (fsdp, expert, tensor) = (2, 2, 2): the completions'
log-probs and their gradient, with the tokens exchanged as a CPU does (gathered, outputs summed) and as TPUs and GPUs do
(ragged all-to-all); the same with LoRA on the experts and the router (the adapters split by expert); online
DPO (policy and reward model both MoE) for two steps trained on 4 devices split by expert with a sampler of its own on
the other 4 (sampler_devices: its experts split by expert too), and the 1-device run resumed from its checkpoint 1 on
(fsdp, expert, tensor) = (2, 2, 2)."""
import json
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from jodpo import train
from tests import helpers, hf_fixtures, subproc

ROOT = Path(__file__).resolve().parents[1]


def _argv(out: Path, checkpoints, dataset: Path, per_device: int, mesh: dict, **more) -> list[str]:
    """Two steps of online DPO, global batch 8, saved after each, evaluation and sample tables off."""
    fields = dict(model_name_or_path=checkpoints["qwen3_moe"]["causal_lm"],
                  reward_model_path=checkpoints["qwen3_moe"]["reward"], dataset_name=dataset, output_dir=out,
                  max_steps=2, save_steps=1, logging_steps=1, per_device_train_batch_size=per_device,
                  max_new_tokens=6, max_length=96, max_prompt_length=64, learning_rate=1e-3, bf16=False,
                  eval_strategy="no", num_sample_generations=0, gradient_accumulation_steps=1,
                  **{f"mesh_{k}": v for k, v in mesh.items()}, **more)
    return ["--config", str(ROOT / "jodpo" / "configs" / "tldr.py"), *(f"--config.{k}={v}" for k, v in fields.items()),
            "--allow_config_change"]


CHILD = """
import json, sys, jax, jax.numpy as jnp, numpy as np
import jodpo
from jodpo import train
from jodpo.models import expert_exchange, moe
from jodpo.parallel import sharding as S
assert jax.device_count() == 8
path, jobs = sys.argv[1], json.loads(sys.argv[2])
ran = []
real = expert_exchange.expert_parallel
expert_exchange.expert_parallel = lambda *a, **k: ran.append(1) or real(*a, **k)
model, one = jodpo.load_model(path)
rng = np.random.default_rng(0)
prompt = rng.integers(3, 290, (8, 7)).astype(np.int32); pmask = np.ones_like(prompt); pmask[1, :3] = 0
comp = rng.integers(3, 290, (16, 5)).astype(np.int32); cmask = np.ones_like(comp); cmask[2, 3:] = 0
def f(p):
    lp = jodpo.completion_logprobs(model, p, prompt, pmask, comp, cmask)
    return jnp.sum(lp * jnp.arange(1, 6)), lp
(_, a), ga = jax.jit(jax.value_and_grad(f, has_aux=True))(one)
def equal_to_one_device():
    for shape in ({'data': 2, 'expert': 4, 'fsdp': 1}, {'fsdp': 2, 'expert': 2, 'tensor': 2}):
        _, split = jodpo.load_model(path, place=S.placer(S.make_mesh(**shape)))
        assert split['layers']['moe']['gate'].sharding.spec[1] == 'expert', shape
        ran.clear()
        (_, b), gb = jax.jit(jax.value_and_grad(f, has_aux=True))(split)
        assert ran, 'the experts did not run split by expert'
        assert gb['layers']['moe']['gate'].sharding.spec[1] == 'expert'
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
        for (k, x), y in zip(jax.tree.leaves_with_path(ga), jax.tree.leaves(gb)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4,
                                       atol=1e-5 * float(np.abs(x).max() or 1), err_msg=jax.tree_util.keystr(k))
    return split
equal_to_one_device()  # a CPU's exchange: the group's tokens gathered, the outputs summed and split again
# TPUs' and GPUs': two ragged all-to-alls (XLA:CPU has none: tests.collectives writes it from all_gather)
from tests.collectives import ragged_all_to_all
expert_exchange.expert_parallel = lambda *a, **k: ran.append(1) or real(*a, exchange=ragged_all_to_all, **k)
split = equal_to_one_device()
expert_exchange.expert_parallel = lambda *a, **k: ran.append(1) or real(*a, **k)
check = [jax.export.DisabledSafetyCheck.custom_call('ragged_all_to_all')]
for platform, a2a in (('tpu', True), ('cuda', True), ('cpu', False)):  # each platform's program: the backend's choice
    text = jax.export.export(jax.jit(jax.grad(lambda p: f(p)[0])), platforms=[platform], disabled_checks=check)(
        split).mlir_module()
    assert ('@ragged_all_to_all' in text, 'reduce_scatter' in text) == (a2a, not a2a), platform
# A TPU's bf16 experts are Pallas' megablox kernels, which XLA cannot partition ("Mosaic kernels cannot be
# automatically partitioned"): they lower inside the shard_map over every axis (shapes the TPU's blocks accept)
import dataclasses
wide = model.replace(dtype='bfloat16', hidden_size=128, moe=dataclasses.replace(model.moe, num_experts=8,
                                                                                expert_dim=256))
mesh = S.make_mesh(fsdp=2, expert=2, tensor=2)
specs = {'gate': ('expert', 'fsdp', 'tensor'), 'up': ('expert', 'fsdp', 'tensor'),
         'down': ('expert', 'tensor', 'fsdp')}
shapes = {'gate': (8, 128, 256), 'up': (8, 128, 256), 'down': (8, 256, 128)}
w = {k: jax.device_put(jnp.ones(shapes[k]), jax.NamedSharding(mesh, jax.P(*specs[k]))) for k in specs}
x, chosen = jnp.ones((16, 128), jnp.bfloat16), jnp.tile(jnp.arange(2), (16, 1))
experts = lambda w, x: moe.sorted_experts(wide, w, x, chosen, jnp.ones((16, 2), jnp.bfloat16)).astype(jnp.float32)
unchecked = [jax.export.DisabledSafetyCheck.custom_call(c) for c in ('ragged_all_to_all', 'tpu_custom_call')]
text = jax.export.export(jax.jit(jax.grad(lambda w, x: jnp.sum(experts(w, x)))), platforms=['tpu'],
                         disabled_checks=unchecked)(w, x).mlir_module()
assert 'tpu_custom_call' in text and '@ragged_all_to_all' in text
# LoRA on the experts and the router (PEFT's all-linear on Qwen3-MoE): the adapters split by expert like the experts,
# merged into them inside the layer, the split experts' run equal to one device's, every adapter's gradient too
from jodpo.models import lora
lora_model = model.replace(lora_rank=2, lora_alpha=4.0)
targets = lora.resolve_targets(lora_model, ['all-linear'])
ad = lora.init_adapters(lora_model, targets, jax.random.key(0))
ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), ad)
def g(a, base):
    lp = jodpo.completion_logprobs(lora_model, lora.attach(base, a), prompt, pmask, comp, cmask)
    return jnp.sum(lp * jnp.arange(1, 6)), lp
(_, a), ga = jax.jit(jax.value_and_grad(g, has_aux=True))(ad, one)
mesh = S.make_mesh(data=2, fsdp=1, expert=4)
_, split = jodpo.load_model(path, place=S.placer(mesh))
split_ad = jax.device_put(ad, S.param_shardings(lora_model, mesh, lora.adapter_specs(lora_model, targets)))
ran.clear()
(_, b), gb = jax.jit(jax.value_and_grad(g, has_aux=True))(split_ad, split)
assert ran, 'the adapted experts did not run split by expert'
assert {k: gb[k]['a'].sharding.spec[1] for k in ('gate_up_proj@moe', 'down_proj@moe')} == dict.fromkeys(
    ('gate_up_proj@moe', 'down_proj@moe'), 'expert')
np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
for (k, x), y in zip(jax.tree.leaves_with_path(ga), jax.tree.leaves(gb)):
    assert np.abs(np.asarray(x)).max() > 0, jax.tree_util.keystr(k)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-5 * float(np.abs(x).max()),
                               err_msg=jax.tree_util.keystr(k))
for argv in jobs:
    ran.clear()
    assert train.main(argv + ['--debug']) == 0, argv
    assert ran, argv
print('EXPERT OK')
"""


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("expert")
    data = hf_fixtures.prompt_dataset(root / "data")
    assert train.main(_argv(root / "one", checkpoints, data, 8, {}) + ["--debug"]) == 0
    resumed = root / "one_then_fet"
    shutil.copytree(root / "one", resumed)
    shutil.rmtree(resumed / "checkpoints" / "2")
    jobs = [_argv(root / "e_sampler_e", checkpoints, data, 2, dict(data=1, fsdp=1, expert=4), sampler_devices=4),
            _argv(resumed, checkpoints, data, 2, dict(fsdp=2, expert=2, tensor=2))]
    python, env = subproc.without_torch(subproc.cpu_env(8))
    done = subprocess.run([*python, "-c", CHILD, str(checkpoints["qwen3_moe"]["causal_lm"]), json.dumps(
        [[str(a) for a in argv] for argv in jobs])], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0 and "EXPERT OK" in done.stdout, done.stderr[-4000:]
    return root


@pytest.mark.parametrize("name", ["e_sampler_e", "one_then_fet"])
def test_expert_axis_on_8_devices_equals_one(runs, name):
    """Log-probs and gradient (in the child), then the runs' logged numbers and final parameters."""
    one, other = helpers.run_metrics(runs / "one"), helpers.run_metrics(runs / name)
    assert sorted(one) == sorted(other) == [1, 2]
    for step in one:
        for k in helpers.SAME_RUN:
            assert other[step][k] == pytest.approx(one[step][k], rel=1e-4, abs=1e-5), (step, k)
    pa, pb = (helpers.restore_params(runs / n / "checkpoints" / "2") for n in ("one", name))
    for (path, x), y in zip(jax.tree.leaves_with_path(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=5e-5, err_msg=str(path))

"""Meshes and shardings: the rules, and whole training runs on 8 fake CPU devices ((data, fsdp, tensor) =
(2, 2, 2) and (8, 1, 1)) and as 2 processes x 4 devices (jax.distributed on 127.0.0.1, gloo) that equal the
1-device run step for step; checkpoints move between 1 and 8 devices in both directions."""
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jodpo
from jodpo import sharding as S
from jodpo import train
from jodpo.checkpoint import restore_params
from tests import hf_fixtures, subproc

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("loss", "logps/chosen", "logps/rejected", "objective/scores", "objective/kl", "rewards/margins",
            "grad_norm")


# --------------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------------


def test_mesh_shape_resolves_minus_one_and_explains_misfits():
    assert S.mesh_shape(1, -1, 1, 8) == (1, 8, 1)
    assert S.mesh_shape(2, 2, -1, 8) == (2, 2, 2)
    assert S.mesh_shape(-1, 1, 1, 1) == (1, 1, 1)
    with pytest.raises(S.MeshError, match="needs 6 devices, there are 8"):
        S.mesh_shape(2, 3, 1, 8)
    with pytest.raises(S.MeshError, match="not a multiple of 3"):
        S.mesh_shape(3, -1, 1, 8)
    with pytest.raises(S.MeshError, match="at most one -1"):
        S.mesh_shape(-1, -1, 1, 8)


class _FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_logical_rules_split_what_divides_and_replicate_the_rest():
    mesh = _FakeMesh(data=2, fsdp=4, tensor=2)
    assert S.spec_for((6, 64, 4, 16), ("layers", "embed", "heads", "head_dim"), mesh) == P(None, "fsdp", "tensor", None)
    assert S.spec_for((6, 64, 1, 16), ("layers", "embed", "kv_heads", "head_dim"), mesh) == P(None, "fsdp", None, None)
    assert S.spec_for((50304, 512), ("vocab", "embed"), mesh) == P("tensor", "fsdp")
    assert S.spec_for((50277, 510), ("vocab", "embed"), mesh) == P(None, None)  # odd sizes stay whole
    assert S.spec_for((512, 1), ("embed", None), mesh) == P("fsdp", None)


def test_optimizer_state_follows_its_parameter(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), S.AXES)
    param_sh = S.param_shardings(model, mesh)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    shardings = S.like_params(jax.eval_shape(tx.init, params), param_sh, mesh)
    mu = shardings[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(param_sh)
    assert all(a is b for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(param_sh)))
    assert shardings[1][0].count.spec == P()


# --------------------------------------------------------------------------------------------------
# Whole runs on several devices and processes
# --------------------------------------------------------------------------------------------------


LORA = ["--config.use_peft=True", "--config.lora_r=4", "--config.lora_target_modules=['all-linear']"]


def _argv(out: Path, checkpoints, dataset: Path, per_device: int, mesh=(1, -1, 1)) -> list[str]:
    """3 steps of online DPO with the reward model on device (NeoX policy + NeoX RM), global batch 8 (``+ LORA``:
    LoRA adapters on every projection, the fused query_key_value included)."""
    fields = dict(model_name_or_path=checkpoints["neox"]["causal_lm"], reward_model_path=checkpoints["neox"]["reward"],
                  dataset_name=dataset, output_dir=out, max_steps=3, save_steps=1, logging_steps=1,
                  per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device, max_new_tokens=6,
                  max_length=96, max_prompt_length=64, learning_rate=1e-3, bf16=False, eval_steps=3,
                  mesh_data=mesh[0], mesh_fsdp=mesh[1], mesh_tensor=mesh[2], num_sample_generations=1)
    return ["--config", str(ROOT / "configs" / "tldr.py"), *(f"--config.{k}={v}" for k, v in fields.items()),
            "--config.gradient_accumulation_steps=1", "--allow_config_change"]


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def _assert_same_run(a: Path, b: Path) -> None:
    ma, mb = _metrics(a), _metrics(b)
    assert sorted(ma) == sorted(mb) == [1, 2, 3]
    for step in ma:
        for k in COMPARED:
            assert mb[step][k] == pytest.approx(ma[step][k], rel=1e-4, abs=1e-5), (step, k)
    final = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()][-1]
    other = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()][-1]
    assert other["eval/objective/scores"] == pytest.approx(final["eval/objective/scores"], rel=1e-4, abs=1e-5)
    pa, pb = restore_params(a / "checkpoints" / "3"), restore_params(b / "checkpoints" / "3")
    for (path, x), y in zip(jax.tree.leaves_with_path(pa), jax.tree.leaves(pb)):
        if "k_bias" in jax.tree_util.keystr(path):
            # The key bias's gradient is exactly 0 in exact arithmetic (softmax ignores a per-query shift), so
            # Adam's normalised step turns float noise into +-lr: no layout can reproduce another's noise.
            continue
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def _run_8_devices(jobs: list[list[str]]) -> list[bool]:
    """Run ``jodpo.train.main`` on each argv in one process with 8 fake CPU devices; returns, per run, whether
    the train state was really split (some array not held whole by every device)."""
    code = (
        "import json, sys, jax\n"
        "from jodpo import train, sharding\n"
        "assert jax.device_count() == 8\n"
        "seen = []\n"
        "real = train.ts.jit_steps\n"
        "def spy(state_sharding, metrics_sharding):\n"
        "    seen.append(any(not s.is_fully_replicated for s in jax.tree.leaves(state_sharding)))\n"
        "    return real(state_sharding, metrics_sharding)\n"
        "train.ts.jit_steps = spy\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    assert train.main(argv + ['--debug']) == 0, argv\n"
        "print('SPLIT', json.dumps(seen))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], capture_output=True, text=True,
                          env=subproc.cpu_env(8),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("SPLIT ")[-1])


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """The 1-device reference, and the same run on 8 devices in two layouts (each saved every step); then
    checkpoint 3 removed from a copy of each, and resumed on the other device count (the mesh fields
    differ, hence --allow_config_change; the run itself is the same)."""
    root = tmp_path_factory.mktemp("sharded")
    data = hf_fixtures.prompt_dataset(root / "data")
    one = root / "one"
    assert train.main(_argv(one, checkpoints, data, per_device=8)) == 0
    resume_on_8 = root / "one_then_8"
    shutil.copytree(one, resume_on_8)
    shutil.rmtree(resume_on_8 / "checkpoints" / "3")
    assert train.main(_argv(root / "lora_one", checkpoints, data, per_device=8) + LORA) == 0
    split = _run_8_devices([_argv(root / "dft", checkpoints, data, 2, (2, 2, 2)),
                            _argv(root / "d8", checkpoints, data, 1, (8, 1, 1)),
                            _argv(resume_on_8, checkpoints, data, 1, (8, 1, 1)),
                            _argv(root / "lora_dft", checkpoints, data, 2, (2, 2, 2)) + LORA])
    # fsdp and tensor split the state (LoRA adapters too); pure data parallelism replicates it
    assert split == [True, False, False, True]
    resume_on_1 = root / "dft_then_1"
    shutil.copytree(root / "dft", resume_on_1)
    shutil.rmtree(resume_on_1 / "checkpoints" / "3")
    assert train.main(_argv(resume_on_1, checkpoints, data, per_device=8)) == 0
    return root, data


@pytest.mark.parametrize("name", ["dft", "d8", "one_then_8", "dft_then_1", "lora_dft"])
def test_8_device_runs_and_moved_checkpoints_equal_the_1_device_run(runs, name):
    root, _ = runs
    _assert_same_run(root / ("lora_one" if name.startswith("lora") else "one"), root / name)


def test_two_processes_of_four_devices_equal_the_1_device_run(runs, checkpoints):
    root, data = runs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / "two_processes"
    env = subproc.cpu_env(4, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    procs = [subprocess.Popen([sys.executable, "-m", "jodpo.train", *_argv(out, checkpoints, data, 1),
                               "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
                               "--process_id", str(i), "--debug"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    _assert_same_run(root / "one", out)
    assert (out / "checkpoints" / "3" / "state" / "ocdbt.process_1").exists()  # both processes wrote their part

"""Meshes and shardings: the rules, and whole training runs on 8 fake CPU devices ((data, fsdp, tensor) =
(2, 2, 2) and (8, 1, 1), none of whose programs XLA reshards by gathering an array whole) that equal the 1-device
run step for step (the tldr.py jobs of 8 devices and of 2 processes
are in test_collective_order.py); checkpoints move between 1 and 8 devices in both directions; sampling on devices of
its own (4 sample, 4 train) equals sampling on the training mesh."""
import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jodpo
from jodpo.parallel import sharding as S
from jodpo import train
from tests import hf_fixtures, subproc
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
# --------------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------------


def test_mesh_shape_resolves_minus_one_and_explains_misfits():
    assert S.mesh_shape(1, -1, 1, 8) == (1, 8, 1, 1)  # (data, fsdp, expert, tensor)
    assert S.mesh_shape(2, 2, -1, 8) == (2, 2, 1, 2)
    assert S.mesh_shape(-1, 1, 1, 1) == (1, 1, 1, 1)
    assert S.mesh_shape(1, 2, 2, 8, expert=-1) == (1, 2, 2, 2)
    with pytest.raises(S.MeshError, match="needs 6 devices, there are 8"):
        S.mesh_shape(2, 3, 1, 8)
    with pytest.raises(S.MeshError, match="not a multiple of 3"):
        S.mesh_shape(3, -1, 1, 8)
    with pytest.raises(S.MeshError, match="at most one -1"):
        S.mesh_shape(-1, 1, 1, 8, expert=-1)


class _FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_logical_rules_split_what_divides_and_replicate_the_rest():
    mesh = _FakeMesh(data=2, fsdp=4, tensor=2)
    assert S.spec_for((6, 64, 4, 16), ("layers", "embed", "heads", "head_dim"), mesh) == P(None, "fsdp", "tensor")
    assert S.spec_for((6, 64, 1, 16), ("layers", "embed", "kv_heads", "head_dim"), mesh) == P(None, "fsdp")
    assert S.spec_for((50304, 512), ("vocab", "embed"), mesh) == P("tensor", "fsdp")
    assert S.spec_for((50277, 510), ("vocab", "embed"), mesh) == P()  # odd sizes stay whole
    assert S.spec_for((512, 1), ("embed", None), mesh) == P("fsdp")
    # the expert axis: an expert's weights split by expert (their embed over fsdp alone), every other embed over
    # fsdp x expert as far as that divides it; experts that do not divide stay whole
    mesh = _FakeMesh(data=1, fsdp=2, expert=4, tensor=1)
    assert S.spec_for((6, 8, 64, 32), ("layers", "expert", "embed", "mlp"), mesh) == P(None, "expert", "fsdp")
    assert S.spec_for((6, 6, 64, 32), ("layers", "expert", "embed", "mlp"), mesh) == P(None, None, ("fsdp", "expert"))
    assert S.spec_for((6, 64, 4, 16), ("layers", "embed", "heads", "head_dim"), mesh) == P(None, ("fsdp", "expert"))
    assert S.spec_for((6, 6, 4, 16), ("layers", "embed", "heads", "head_dim"), mesh) == P(None, "fsdp")
    # trailing whole axes left out, as XLA writes a program's output shardings (jax tells P(x, None) from P(x))
    assert S.spec_for((8, 64), ("vocab", "embed"), _FakeMesh(tensor=2, fsdp=1)) == P("tensor")


def test_optimizer_state_follows_its_parameter(checkpoints):
    model, params = jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), S.AXES)
    param_sh = S.param_shardings(model, mesh)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    shardings = S.like_params(jax.eval_shape(tx.init, params), param_sh, mesh)
    mu = shardings[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(param_sh)
    assert all(a is b for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(param_sh)))
    assert shardings[1][0].count.spec == P()


def test_the_sampler_mesh_takes_the_last_devices_and_explains_misfits():
    """sampler_devices=k: the training mesh lays out the first n - k devices, the sampler's (data-parallel, with the
    training mesh's tensor split) the last k; each misfit is one clear ConfigError."""
    code = (
        "import jax, pytest\n"
        "from jodpo.program.config import ConfigError, TrainConfig\n"
        "from jodpo.program.run import meshes\n"
        "ids = lambda m: sorted(d.id for d in m.devices.flat)\n"
        "train, sampler = meshes(TrainConfig(sampler_devices=2, mesh_tensor=2, per_device_train_batch_size=2))\n"
        "assert ids(train) == list(range(6)) and dict(train.shape) == {'data': 1, 'fsdp': 3, 'expert': 1, 'tensor': 2}\n"
        "assert ids(sampler) == [6, 7] and dict(sampler.shape) == {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 2}\n"
        "train, sampler = meshes(TrainConfig(sampler_devices=4))\n"
        "assert ids(sampler) == [4, 5, 6, 7] and dict(sampler.shape) == {'data': 4, 'fsdp': 1, 'expert': 1, 'tensor': 1}\n"
        "train, sampler = meshes(TrainConfig(sampler_devices=4, mesh_expert=2, per_device_train_batch_size=2))\n"
        "assert dict(sampler.shape) == {'data': 2, 'fsdp': 1, 'expert': 2, 'tensor': 1}  # the experts split there too\n"
        "for fields, phrase in [\n"
        "        (dict(sampler_devices=8), 'leaves none of the 8 devices to train on'),\n"
        "        (dict(sampler_devices=2, mesh_tensor=3), \"not a multiple of the training mesh's tensor x expert size 3 x 1\"),\n"
        "        (dict(sampler_devices=3, per_device_train_batch_size=1),\n"
        "         \"a micro-batch of 5 prompts does not split over the sampler's 3 data-parallel devices\")]:\n"
        "    with pytest.raises(ConfigError, match=phrase):\n"
        "        meshes(TrainConfig(**fields))\n"
        "jax.process_count = lambda: 2\n"
        "with pytest.raises(ConfigError, match='needs a single-process run'):\n"
        "    meshes(TrainConfig(sampler_devices=4))\n"
        "print('MESHES OK')\n")
    python, env = subproc.without_torch(subproc.cpu_env(8))
    done = subprocess.run([*python, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "MESHES OK" in done.stdout, done.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# Whole runs on several devices and processes
# --------------------------------------------------------------------------------------------------


LORA = ["--config.use_peft=True", "--config.lora_r=4", "--config.lora_target_modules=['all-linear']"]
# async_mode, with the sampler refreshed every other rollout (sync_steps=2) and best-of-3 pairs (num_generations=3)
ASYNC = ["--config.async_mode=True", "--config.sync_steps=2", "--config.num_generations=3"]
SPLIT = ["--config.sampler_devices=4"]
NASH_MD = ["--config.method=nash_md", "--config.mixture_coef=0.3"]


def _argv(out: Path, checkpoints, dataset: Path, per_device: int, mesh=(1, -1, 1), resumable=False) -> list[str]:
    """3 steps of online DPO with the reward model on device (NeoX policy + NeoX RM), global batch 8 (``+ LORA``:
    LoRA adapters on every projection, the fused query_key_value included), saved at the end (``resumable``: after
    every step, for ``helpers.resumable_copy``)."""
    fields = dict(model_name_or_path=checkpoints["neox"]["causal_lm"], reward_model_path=checkpoints["neox"]["reward"],
                  dataset_name=dataset, output_dir=out, max_steps=3, save_steps=1 if resumable else 3, logging_steps=1,
                  per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device, max_new_tokens=6,
                  max_length=96, max_prompt_length=64, learning_rate=1e-3, bf16=False, eval_steps=3,
                  mesh_data=mesh[0], mesh_fsdp=mesh[1], mesh_tensor=mesh[2], num_sample_generations=1)
    return ["--config", str(ROOT / "jodpo" / "configs" / "tldr.py"), *(f"--config.{k}={v}" for k, v in fields.items()),
            "--config.gradient_accumulation_steps=1", "--allow_config_change"]


def _run_8_devices(jobs: list[tuple[list[str], Path | None, Path | None]]) -> tuple[list[bool], list[list]]:
    """Run ``jodpo.train.main`` on each job's argv in one process with 8 fake CPU devices (after
    ``helpers.resumable_copy(src, dst)`` when the job names them: a run to resume); returns, per run, whether
    the train state was really split (some array not held whole by every device), and the events of its sampler
    mesh (sampler_devices; none without): ``["launch", step, devices, version]``, where a rollout's sampling
    started (version: the optimizer step of the weights it samples with), and ``["train", step, devices]``, where
    its completions went to be trained on, in the order they happened."""
    code = (
        "import json, sys, jax\n"
        "from pathlib import Path\n"
        "from jodpo import train\n"
        "from jodpo.program import loop\n"
        "from tests.helpers import resumable_copy\n"
        "assert jax.device_count() == 8\n"
        "seen, sampled = [], []\n"
        "real = loop.ts.jit_steps\n"
        "def spy(state_sharding, metrics_sharding):\n"
        "    seen.append(any(not s.is_fully_replicated for s in jax.tree.leaves(state_sharding)))\n"
        "    return real(state_sharding, metrics_sharding)\n"
        "loop.ts.jit_steps = spy\n"
        "def devices(x):\n"
        "    return sorted(d.id for d in x.tokens.devices())\n"
        "real_launch, real_samples = loop.SplitSampler.launch, loop.SplitSampler.samples\n"
        "def launch_spy(self, params, step, version):\n"
        "    real_launch(self, params, step, version)\n"
        "    sampled[-1].append(['launch', step, devices(self.pending[1]), self.weights_step])\n"
        "def samples_spy(self, state, step):\n"
        "    out = real_samples(self, state, step)\n"
        "    sampled[-1].append(['train', step, devices(out)])\n"
        "    return out\n"
        "loop.SplitSampler.launch, loop.SplitSampler.samples = launch_spy, samples_spy\n"
        "for argv, src, dst in json.loads(sys.argv[1]):\n"
        "    if src:\n"
        "        resumable_copy(Path(src), Path(dst))\n"
        "    sampled.append([])\n"
        "    assert train.main(argv + ['--debug']) == 0, argv\n"
        "print('SPLIT', json.dumps([seen, sampled]))\n")
    jobs = [(argv, src and str(src), dst and str(dst)) for argv, src, dst in jobs]
    python, env = subproc.without_torch(subproc.cpu_env(8))
    done = subprocess.run([*python, "-c", code, json.dumps(jobs)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    # no resharding that XLA's partitioner can only do by gathering the whole array on every chip (18 of them in a
    # (2, 2, 2) run's programs, before layers.rows_split split the looked-up rows over data first)
    assert "Involuntary full rematerialization" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.split("SPLIT ")[-1])


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """The 1-device reference, and the same run on 8 devices in two layouts (these three saved every step); then
    checkpoint 3 removed from a copy of each, and resumed on the other device count (the mesh fields
    differ, hence --allow_config_change; the run itself is the same)."""
    root = tmp_path_factory.mktemp("sharded")
    data = hf_fixtures.prompt_dataset(root / "data")
    one = root / "one"
    assert train.main(_argv(one, checkpoints, data, per_device=8, resumable=True)) == 0
    resume_on_8 = helpers.resumable_copy(one, root / "one_then_8")
    assert train.main(_argv(root / "lora_one", checkpoints, data, per_device=8) + LORA) == 0
    assert train.main(_argv(root / "async_one", checkpoints, data, per_device=8) + ASYNC) == 0
    # TRL 1.12's Nash-MD with LoRA adapters (saved every step, resumed on 8 devices below): two models decoded at
    # once (the reference is the adapters off), their mixture over the vocabulary (XPO's decode is the same loop,
    # the reference's rows alone)
    assert train.main(_argv(root / "nash_md_lora_one", checkpoints, data, per_device=8, resumable=True)
                      + NASH_MD + LORA) == 0
    nash_md_resumed = helpers.resumable_copy(root / "nash_md_lora_one", root / "nash_md_lora_one_then_dft")
    # open-instruct's async_mode on one 8-device mesh, then with a sampler mesh of its own (4 devices that sample,
    # (1, 2, 2) that train), also resumed from the single mesh's checkpoint 2; and LoRA (synchronous, its adapters
    # split over fsdp x tensor) sampled apart
    async_then_split = root / "async_then_split"
    split, sampled = _run_8_devices([
        (_argv(root / "dft", checkpoints, data, 2, (2, 2, 2), resumable=True), None, None),
        (_argv(root / "d8", checkpoints, data, 1, (8, 1, 1)), None, None),
        (_argv(resume_on_8, checkpoints, data, 1, (8, 1, 1)), None, None),
        (_argv(root / "async", checkpoints, data, 2, (2, 2, 2), resumable=True) + ASYNC, None, None),
        (_argv(root / "async_split", checkpoints, data, 4, (1, 2, 2)) + ASYNC + SPLIT, None, None),
        (_argv(async_then_split, checkpoints, data, 4, (1, 2, 2)) + ASYNC + SPLIT, root / "async", async_then_split),
        (_argv(root / "lora_split", checkpoints, data, 4, (1, 2, 2)) + LORA + SPLIT, None, None),
        (_argv(nash_md_resumed, checkpoints, data, 2, (2, 2, 2)) + NASH_MD + LORA, None, None)])
    # fsdp and tensor split the state (LoRA adapters too); pure data parallelism replicates it
    assert split == [True, False, False, True, True, True, True, True]
    assert sampled[:4] == [[]] * 4
    assert sampled[7:] == [[]]
    (root / "sampled.json").write_text(json.dumps(dict(zip(["async_split", "async_then_split", "lora_split"],
                                                           sampled[4:7]))))
    resume_on_1 = helpers.resumable_copy(root / "dft", root / "dft_then_1")
    assert train.main(_argv(resume_on_1, checkpoints, data, per_device=8)) == 0
    return root, data


SAME_AS = {"lora_split": "lora_one", "async": "async_one", "nash_md_lora_one_then_dft": "nash_md_lora_one"}


@pytest.mark.parametrize("name", ["dft", "d8", "one_then_8", "dft_then_1", "lora_split", "async",
                                  "nash_md_lora_one_then_dft"])
def test_8_device_runs_and_moved_checkpoints_equal_the_1_device_run(runs, name):
    """Also TRL 1.12's Nash-MD with LoRA adapters, resumed from the 1-device run's checkpoint 2 on a (2, 2, 2) mesh
    (exact resume)."""
    root, _ = runs
    helpers.assert_same_run(root / SAME_AS.get(name, "one"), root / name)


@pytest.mark.parametrize("name", ["async_split", "async_then_split"])
def test_sampling_on_its_own_devices_equals_async_mode_on_one_mesh(runs, name):
    """sampler_devices=4 on 8 devices: the async run (and one resumed there from the single mesh's checkpoint) equals
    async_mode on one (2, 2, 2) mesh; each rollout is sampled on devices 4-7 and trained on 0-3, and the next
    rollout's sampling starts before this one's update (the overlap). With sync_steps=2 the three rollouts all
    sample with the initial weights (the last multiple of 2 before the previous rollout), sent once."""
    root, _ = runs
    helpers.assert_same_run(root / "async", root / name)
    # the one-step lag is in effect: the sampler's log-probs are not the policy's, and the run is not the sync one
    assert helpers.run_metrics(root / "async")[3]["objective/off_policy_kl"] > 0.01
    assert abs(helpers.run_metrics(root / "async")[3]["loss"] - helpers.run_metrics(root / "one")[3]["loss"]) > 1e-3
    sampler, trainer = [4, 5, 6, 7], [0, 1, 2, 3]
    events = json.loads((root / "sampled.json").read_text())
    if name == "async_split":
        assert events[name] == [["launch", 0, sampler, 0], ["launch", 1, sampler, 0], ["train", 0, trainer],
                                ["launch", 2, sampler, 0], ["train", 1, trainer], ["train", 2, trainer]]
    else:
        assert events[name] == [["launch", 2, sampler, 0], ["train", 2, trainer]]
    # without async_mode each rollout waits for the update before it: the sampler and the trainer take turns
    assert events["lora_split"] == [x for s in range(3) for x in (["launch", s, sampler, s], ["train", s, trainer])]


def test_qwen3_and_gemma_parameters_split_over_8_devices_equal_one(checkpoints):
    """Gemma 3's per-head q/k norms, four norms a layer and local RoPE, Qwen3.5's DeltaNet layers (their key and value
    heads split over the tensor axis) and gated attention, OLMo 3's q/k norms over the whole projections (their heads
    split: the norm's mean spans the tensor axis), Gemma 4's global layers of another shape, KV sharing, double-wide
    MLPs and per-layer embeddings (the table split), Qwen3.5-MoE's experts (their inputs over fsdp, their width over
    tensor, the CPU's tiles) and shared expert, with every parameter split by its logical axes over (data, fsdp,
    tensor) = (2, 2, 2) (the per-head norms' head_dim never split): the completions' log-probs and their gradient
    equal one device's. (Qwen3's q/k norms are Gemma 3's; Gemma 2's soft-caps and SmolLM3's NoPE layers add no
    parameter and nothing split; the sharded runs above are GPT-NeoX's.)"""
    code = (
        "import sys, jax, jax.numpy as jnp, numpy as np\n"
        "import jodpo\n"
        "from jodpo.parallel import sharding as S\n"
        "assert jax.device_count() == 8\n"
        "mesh = S.make_mesh(2, 2, 2)\n"
        "rng = np.random.default_rng(0)\n"
        "for path in sys.argv[1:]:\n"
        "    model, one = jodpo.load_model(path)\n"
        "    _, split = jodpo.load_model(path, place=S.placer(mesh))\n"
        "    assert not split['layers']['attn']['q'].sharding.is_fully_replicated\n"
        "    for w in ('in_q', 'in_v', 'out') if 'deltanet' in one['layers'] else ():\n"
        "        assert 'tensor' in str(split['layers']['deltanet'][w].sharding.spec), w\n"
        "    if 'embed_per_layer' in one:  # Gemma 4's per-layer table [N * Dp, V]: split by its N * Dp values\n"
        "        spec = split['embed_per_layer'].sharding.spec\n"
        "        assert tuple(spec) == (('tensor', 'fsdp'),), spec\n"
        "    if 'moe' in one['layers']:  # the experts split over their inputs (fsdp) and width (tensor), not over E\n"
        "        spec = tuple(split['layers']['moe']['gate'].sharding.spec)\n"
        "        assert spec == (None, None, 'fsdp', 'tensor'), spec\n"
        "    if 'q_norm' in one['layers']['attn'] and one['layers']['attn']['q_norm']['scale'].ndim == 2:\n"
        "        assert split['layers']['attn']['q_norm']['scale'].sharding.is_fully_replicated\n"
        "    prompt = rng.integers(3, 290, (4, 7)).astype(np.int32); pmask = np.ones_like(prompt); pmask[1, :3] = 0\n"
        "    x = jax.jit(lambda p, t: jodpo.models.layers.embed(model, p, t))(split, prompt)\n"
        "    assert tuple(x.sharding.spec)[:1] == (('data', 'fsdp'),), x.sharding.spec  # the rows as the batch's\n"
        "    comp = rng.integers(3, 290, (8, 5)).astype(np.int32); cmask = np.ones_like(comp); cmask[2, 3:] = 0\n"
        "    def f(p):\n"
        "        lp = jodpo.completion_logprobs(model, p, prompt, pmask, comp, cmask)\n"
        "        return jnp.sum(lp * jnp.arange(1, 6)), lp\n"
        "    (_, a), ga = jax.jit(jax.value_and_grad(f, has_aux=True))(one)\n"
        "    (_, b), gb = jax.jit(jax.value_and_grad(f, has_aux=True))(split)\n"
        "    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)\n"
        "    tol = 4e-5 if model.family == 'gemma4' else 1e-5  # Gemma 4's float32 gradients: 1-3e-5 from float64's\n"
        "    for (k, x), y in zip(jax.tree.leaves_with_path(ga), jax.tree.leaves(gb)):\n"
        "        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4,\n"
        "                                   atol=tol * float(np.abs(np.asarray(x)).max() or 1), err_msg=jax.tree_util.keystr(k))\n"
        "print('SPLIT OK')\n")
    python, env = subproc.without_torch(subproc.cpu_env(8))
    paths = [str(checkpoints[f]["causal_lm"]) for f in ("qwen3_5", "gemma3", "olmo3", "gemma4", "qwen3_5_moe")]
    done = subprocess.run([*python, "-c", code, *paths], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "SPLIT OK" in done.stdout, done.stderr[-3000:]

"""scripts/export_hf.py: train a few steps (``python -m jodpo.train``'s main), export, load with transformers; sharded
and bf16 files; a checkpoint written on 8 devices exports on 1; refusals and unreadable checkpoints."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jodpo
from jodpo import train
from jodpo.program.checkpoint import restore_params
from tests import helpers, hf_fixtures, subproc

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "export_hf.py"
export_hf = helpers.export_hf


def _train(checkpoints, family: str, root: Path, steps: int, **more) -> Path:
    """``python -m jodpo.train`` (its main, in this process) for ``steps`` steps of a tiny family variant."""
    out = root / "run"
    fields = more | dict(model_name_or_path=checkpoints[family]["causal_lm"], reward_model_path=checkpoints[family]["reward"],
                  dataset_name=hf_fixtures.prompt_dataset(root / "data"), output_dir=out, max_steps=steps,
                  save_steps=1, per_device_train_batch_size=2, max_new_tokens=4, max_length=96,
                  max_prompt_length=64, learning_rate=1e-2, bf16=False, logging_steps=1)
    assert train.main([f"--config.{k}={v}" for k, v in fields.items()]) == 0
    return out


def _relative_error(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(a))))


@pytest.fixture(scope="module")
def neox_run(checkpoints, tmp_path_factory):
    return _train(checkpoints, "neox", tmp_path_factory.mktemp("neox"), steps=2)


@pytest.mark.parametrize("family", ["neox", "llama", "llama_tied", "mistral", "qwen2", "qwen3_5", "smollm3", "olmo3",
                                    "gemma4", "qwen3_moe"])
def test_trained_policy_exports_to_transformers(checkpoints, tmp_path, family, neox_run):
    steps = 2 if family == "neox" else 3
    # the load-balancing loss on, logged; routing replay on, over two micro-batches: in float32 the sampler's experts
    # are the trainer's own (moe/route_flip_rate 0), token for token through the window's layout
    aux = dict(router_aux_loss_coef=0.01, moe_routing_replay=True, gradient_accumulation_steps=2) \
        if family == "qwen3_moe" else {}
    run = neox_run if family == "neox" else _train(checkpoints, family, tmp_path, steps, **aux)
    if aux:
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert all(np.isfinite(m["aux_loss"]) and m["aux_loss"] > 0 for m in lines if "loss" in m)
        assert [m["moe/route_flip_rate"] for m in lines if "loss" in m] == [0.0] * steps
    out, checks = export_hf.export(str(run), str(tmp_path / "hf"))
    assert "bitwise" in checks[0] and "transformers" in checks[1]
    trained = restore_params(run / "checkpoints" / str(steps))
    model, exported = jodpo.load_model(str(out))
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise in fp32
    _, initial = jodpo.load_model(str(checkpoints[family]["causal_lm"]))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(exported))]
    assert sum(moved) >= 0.8 * len(moved), moved  # two Adam steps at lr 1e-2 move (nearly) every tensor

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [5, 9], model.pad_token_id, "left")
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()[mask > 0]
    ours = np.asarray(jodpo.logits(model, trained, ids, mask))[mask > 0]
    assert _relative_error(ours, theirs) < 1e-4
    assert hf.config.tie_word_embeddings == model.tie_embeddings
    if model.tie_embeddings:
        assert hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    card = (out / "README.md").read_text()
    assert f"step {steps}" in card and '"learning_rate": 0.01' in card


def test_cli_bf16_sharded_export_and_refusals(neox_run, tmp_path):
    out = tmp_path / "hf"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(neox_run / "checkpoints" / "1"), "--out", str(out),
           "--dtype", "bfloat16", "--max-shard-size", "40KB"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "bitwise" in done.stdout and "transformers" in done.stdout
    assert "Metadata file does not exist" not in done.stderr and "WARNING" not in done.stderr, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in out.glob("model-*.safetensors")) == files
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out)  # the dtype in config.json
    assert hf.dtype == torch.bfloat16
    step1 = restore_params(neox_run / "checkpoints" / "1")
    _, reread = jodpo.load_model(str(out))
    for a, b in zip(jax.tree.leaves(step1), jax.tree.leaves(reread)):
        np.testing.assert_array_equal(np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32), np.asarray(b))

    # A non-empty --out is refused and left alone; --overwrite replaces it (with step 2, one file).
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "not empty" in again.stderr and "Traceback" not in again.stderr
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == files
    assert export_hf.main(["--checkpoint", str(neox_run), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and not list(out.glob("model-*"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left

    assert export_hf.main(["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_an_export_that_fails_its_read_back_check_leaves_nothing(neox_run, tmp_path, monkeypatch, capsys):
    def mismatch(model, params, out, *a, **k):
        assert (Path(out) / "config.json").is_file()  # written whole, then checked
        raise export_hf.ExportMismatch(f"{out}: re-read parameters differ from the exported ones: ['embed']")

    monkeypatch.setattr(export_hf, "verify_export", mismatch)
    assert export_hf.main(["--checkpoint", str(neox_run), "--out", str(tmp_path / "bad")]) == 1
    assert "does not match the checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())


def test_unreadable_latest_checkpoint_falls_back(neox_run, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(neox_run, run)
    shutil.rmtree(run / "source_model")  # as a run from before source_model/ existed: model_name_or_path is used
    for f in (run / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    out, _ = export_hf.export(str(run), str(tmp_path / "hf"))
    assert "trying the previous checkpoint" in caplog.text
    _, params = jodpo.load_model(str(out))
    for a, b in zip(jax.tree.leaves(restore_params(neox_run / "checkpoints" / "1")), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Only that step, and it is unreadable: a clear error.
    assert export_hf.main(["--checkpoint", str(run / "checkpoints" / "2"), "--out", str(tmp_path / "y")]) == 2


def test_checkpoint_written_on_8_devices_exports_on_1(neox_run, tmp_path):
    run = tmp_path / "run8"
    shutil.copytree(neox_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    code = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jodpo.program.checkpoint import Checkpointer, restore_params
        assert len(jax.devices()) == 8
        mesh = Mesh(np.array(jax.devices()), ("fsdp",))
        def shard(x):  # split the largest axis that 8 divides, as an FSDP layout would
            axes = [i for i in np.argsort(x.shape)[::-1] if x.shape[i] % 8 == 0]
            spec = [None] * x.ndim
            if axes:
                spec[axes[0]] = "fsdp"
            return jax.device_put(x, NamedSharding(mesh, P(*spec)))
        params = jax.tree.map(shard, restore_params({str(neox_run / "checkpoints" / "2")!r}))
        assert any(len(x.addressable_shards) == 8 and x.addressable_shards[0].data.shape != x.shape
                   for x in jax.tree.leaves(params))
        ckpt = Checkpointer({str(run / "checkpoints")!r})
        ckpt.save(2, {{"params": params, "step": jax.numpy.int32(2)}}, {{"step": 2}})
        ckpt.close()
    """)
    python, env = subproc.without_torch(subproc.cpu_env(8))
    done = subprocess.run([*python, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert jax.device_count() < 8  # the export runs in this process, not on the mesh that wrote the checkpoint
    out, checks = export_hf.export(str(run), str(tmp_path / "hf"))
    _, params = jodpo.load_model(str(out))
    for a, b in zip(jax.tree.leaves(restore_params(neox_run / "checkpoints" / "2")), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        export_hf.main(["--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    for default in ("(default: float32, bitwise the trained ones)", "(default: 5GB)", "(default: refuse)",
                    "(default: the merged model)", "its newest checkpoint"):
        assert default in shown, shown

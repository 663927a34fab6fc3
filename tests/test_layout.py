"""jodpo.models.layout: the layers run as scans over repeating periods, whatever the pattern (a body compiled once
per period, not once per layer), and inside a period one scan per group of layers of one kind."""
import json
from pathlib import Path

import pytest

from jodpo.models import decoder
from jodpo.models.layout import groups, layer_runs
from jodpo.models.loading import model_from_dir
from tests import hf_fixtures

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
CODE = {"attention": "A", "sliding_attention": "S", "global_attention": "G", "shared_sliding_attention": "s",
        "shared_global_attention": "g", "deltanet": "D"}
# every real config of benchmarks/configs -> its runs: (period, repetitions)
EXPECTED = {
    # Gemma 3: five sliding layers (a cache of the window's slots) to a global one; 26 and 34 layers end on sliding ones
    "gemma-3-1b": [("SSSSSA", 4), ("S", 2)], "gemma-3-4b": [("SSSSSA", 5), ("S", 4)], "gemma-3-12b": [("SSSSSA", 8)],
    "gemma-4-e2b": [("SSSSG", 3), ("ssssg", 4)], "gemma-4-e4b": [("SSSSSG", 4), ("sssssg", 3)],
    "gemma-4-31b": [("SSSSSG", 10)], "gemma-4-26b-a4b": [("SSSSSG", 5)],
    "qwen3-0.6b": [("A", 28)], "qwen3-1.7b": [("A", 28)], "qwen3-4b": [("A", 36)], "qwen3-8b": [("A", 36)],
    "qwen3.5-0.8b": [("DDDA", 6)], "qwen3.5-2b": [("DDDA", 6)], "qwen3.5-4b": [("DDDA", 8)],
    "qwen3.5-9b": [("DDDA", 8)],
    "qwen3-30b-a3b": [("A", 48)], "olmoe-1b-7b": [("A", 16)], "qwen3.5-35b-a3b": [("DDDA", 10)],
}
# the cache-free forwards' (a step's log-probs and their gradient): the full and the sliding attention have the same
# parameters, so Gemma 3's layers are one scan, each layer's own kind chosen per layer (decoder._scan_kinds)
CACHE_FREE = {"gemma-3-1b": [("S", 26)], "gemma-3-4b": [("S", 34)], "gemma-3-12b": [("S", 48)]}


def test_every_benchmark_config_is_listed():
    assert sorted(EXPECTED) == sorted(p.stem for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_configs_scan_over_their_repeating_periods(name, tmp_path):
    """Gemma 4 E2B's 35 layers compiled as one unrolled body (no single period covers them): now a scan of its
    (sliding x 4, global) period, then one of its KV-sharing layers' period."""
    (tmp_path / "config.json").write_text((CONFIGS / f"{name}.json").read_text())
    model = model_from_dir(tmp_path, "causal_lm", "bfloat16")
    runs = layer_runs(model.kinds)
    assert [("".join(CODE[k] for k in r.period), r.reps) for r in runs] == EXPECTED[name]
    assert runs[0].start == 0 and runs[-1].end == model.num_layers
    assert all(a.end == b.start for a, b in zip(runs, runs[1:]))
    kinds, variants = decoder._scan_kinds(model)
    assert [("".join(CODE[k] for k in r.period), r.reps) for r in layer_runs(kinds)] == CACHE_FREE.get(
        name, EXPECTED[name])
    assert all(model.kinds[i] in variants.get(k, (k,)) for i, k in enumerate(kinds))


def _kinds(code: str) -> tuple[str, ...]:
    back = {v: k for k, v in CODE.items()}
    return tuple(back[c] for c in code)


@pytest.mark.parametrize("code, runs", [
    ("SSSS", [("S", 4)]),
    ("SGSGSG", [("SG", 3)]),
    ("SGSssS", [("SGS", 1), ("s", 2), ("S", 1)]),  # nothing repeats at first: layers run once until something does
    ("SGSSSS", [("SG", 1), ("S", 4)]),
    ("SSGSSGSSGS", [("SSG", 3), ("S", 1)]),
    ("SGs", [("SGs", 1)]),
])
def test_layers_where_no_period_repeats_run_once_until_one_does(code, runs):
    assert [("".join(CODE[k] for k in r.period), r.reps) for r in layer_runs(_kinds(code))] == runs


def test_a_period_scans_each_group_of_one_kind():
    assert groups(_kinds("DDDA")) == ((0, "deltanet", 3), (3, "attention", 1))
    assert groups(_kinds("SSSSG")) == ((0, "sliding_attention", 4), (4, "global_attention", 1))
    assert groups(_kinds("SGs")) == ((0, "sliding_attention", 1), (1, "global_attention", 1),
                                     (2, "shared_sliding_attention", 1))


def test_the_expected_runs_are_the_configs_layer_types():
    """The table above is what the configs say: Gemma 4's and Qwen3.5's layer types, not the code's reading of them."""
    e2b = json.loads((CONFIGS / "gemma-4-e2b.json").read_text())
    types = e2b.get("layer_types") or []
    assert len(types) == 35 and [t == "full_attention" for t in types].count(True) == 7
    q = json.loads((CONFIGS / "qwen3.5-0.8b.json").read_text())
    assert q["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]


def _repeating_gemma4(checkpoints, out: Path) -> Path:
    """The suite's Gemma 4 (four layers, one of each kind: nothing repeats, so no scan) as ten layers in the real
    models' shape: (sliding, global) x 3, then the KV-sharing layers' (sliding, global) x 2."""
    config = json.loads((checkpoints["gemma4"]["causal_lm"] / "config.json").read_text())
    config.update(num_hidden_layers=10, layer_types=["sliding_attention", "full_attention"] * 5, num_kv_shared_layers=4,
                  per_layer_config={str(i): config["per_layer_config"]["1"] for i in range(1, 10, 2)})
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


def _repeating_pair(checkpoints, family: str, out: Path) -> Path:
    """Gemma 2's and 3's fixtures (a sliding layer, then a global one: two kinds, nothing repeats) as the real models
    repeat them: (sliding, global) x 2, one scan of two repetitions."""
    config = json.loads((checkpoints[family]["causal_lm"] / "config.json").read_text())
    config.update(num_hidden_layers=4, layer_types=config["layer_types"] * 2)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", hf_fixtures.DECODER_FAMILIES)
def test_rematerialisation_holds_fewer_temporaries_in_every_family(checkpoints, family, tmp_path):
    """The gradient of a step's log-probs holds fewer XLA temporaries with each layer rematerialised than without:
    remat pays in every family's scans (in Gemma 4 E2B's single unrolled body it saved nothing). At lengths where the
    layers' activations outweigh the rest; the Gemma fixtures, whose layers do not repeat, repeated as the real models'
    do."""
    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo.losses import completion_logprobs
    from jodpo.models.loading import describe_model

    path = {"gemma4": lambda: _repeating_gemma4(checkpoints, tmp_path / "g4"),
            "gemma2": lambda: _repeating_pair(checkpoints, family, tmp_path / "g"),
            "gemma3": lambda: _repeating_pair(checkpoints, family, tmp_path / "g")}.get(
        family, lambda: checkpoints[family]["causal_lm"])()
    model = describe_model(str(path))
    params = jax.eval_shape(lambda: jodpo.init_params(model, jax.random.key(0)))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    batch = (i32(4, 256), i32(4, 256), i32(8, 64), i32(8, 64))
    temporaries = {}
    for remat in ("full", "none"):
        m = model.replace(remat=remat)
        grad = jax.grad(lambda p, *b, m=m: completion_logprobs(m, p, *b).sum())
        compiled = jax.jit(grad).lower(params, *batch).compile()
        temporaries[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries["full"] < temporaries["none"], temporaries


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_rematerialised_period_gives_the_gradients_of_none(checkpoints, family, tmp_path):
    """A period of several groups repeated (Qwen3.5's (DeltaNet, attention) x 2; Gemma 3's (sliding, global) x 2) is
    rematerialised whole and layer by layer: the gradient of a step's log-probs is the one without remat."""
    import jax
    import numpy as np

    import jodpo
    from jodpo.losses import completion_logprobs
    from jodpo.models.loading import describe_model

    path = _repeating_pair(checkpoints, family, tmp_path / "g") if family == "gemma3" else checkpoints[family][
        "causal_lm"]
    model = describe_model(str(path))
    assert [(len(groups(r.period)), r.reps) for r in layer_runs(model.kinds)] == [(2, 2)]
    params = jodpo.init_params(model, jax.random.key(1), std=0.1)
    rng = np.random.default_rng(0)
    batch = (rng.integers(3, 250, (2, 9)), np.ones((2, 9), np.int32), rng.integers(3, 250, (4, 5)),
             np.ones((4, 5), np.int32))
    grads = {remat: jax.jit(jax.grad(lambda p, m=model.replace(remat=remat): completion_logprobs(m, p, *batch).sum()))(
        params) for remat in ("full", "none")}
    # float32 roundings apart: DeltaNet's log-decay gradients (a_log, dt_bias) sum over every position with
    # cancellation, and each of the two is 0.5-2.5e-5 (relative to the largest) from a float64 gradient (2026-12-03)
    for got, want in zip(jax.tree.leaves(grads["full"]), jax.tree.leaves(grads["none"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=4e-5 * np.abs(want).max())

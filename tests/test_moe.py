"""The mixture-of-experts feed-forward (jodpo.models.moe) against transformers: each layer's router and chosen experts,
the load-balancing loss, the grouped (dropless) experts against the one-hot reference, values and gradients, the fused
hub layout, and the settings jodpo refuses. The tiny Qwen3-MoE and OLMoE of tests/hf_fixtures.py; their logits,
reward heads, decoding and exports are in the family-parametrized tests. Gemma 4 26B-A4B (experts beside a dense MLP),
not among those (the suite's time): its logits, routing, greedy decoding and a trained model's export here."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import jodpo
from jodpo.errors import CheckpointError
from jodpo.models import decoder, lora, moe
from jodpo.models.model import MoE
from tests import helpers, hf_fixtures, references

MOE_FAMILIES = ("qwen3_moe", "olmoe", "qwen3_5_moe")


def _hf(path, **config):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **config).eval()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_layer_routes_as_transformers_and_the_aux_loss_equals_theirs(checkpoints, family):
    path = checkpoints[family]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(3), [11, 4, 8], model.pad_token_id, "left")
    _, _, ours = jax.jit(decoder.hidden_states, static_argnums=0, static_argnames="with_router")(
        model, params, ids, mask, with_router=True)
    ours = np.asarray(ours.logits)  # [N, B, L, E]
    aux = float(moe.load_balancing_loss(model.moe, jnp.asarray(ours), mask))
    hf = _hf(path, output_router_logits=True, router_aux_loss_coef=0.5)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0), dtype=torch.long))
    theirs = np.stack([r.numpy().reshape(ours.shape[1:]) for r in out.router_logits])
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[:, real], theirs[:, real], rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    k = model.moe.top_k
    chosen = lambda logits: np.sort(np.argsort(-logits, -1, kind="stable")[..., :k], -1)  # noqa: E731
    np.testing.assert_array_equal(chosen(ours[:, real]), chosen(theirs[:, real]))
    np.testing.assert_allclose(aux, float(out.aux_loss), rtol=1e-5)
    assert aux > 1.0  # E * sum(f p) is 1 when balanced; a real number, not a zero from an empty mask


def _tiny_block(E=5, k=2, D=8, F=6, shared=0, norm=True):
    m = MoE(num_experts=E, top_k=k, expert_dim=F, norm_topk_prob=norm, shared_dim=shared)
    model = decoder.Model(family="qwen3_moe", task="causal_lm", vocab_size=8, hidden_size=D, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=D, mlp=None, norms=decoder.Norms("rmsnorm", 1e-6),
                          qkv_bias=False, out_bias=False,
                          parallel_residual=False, rope=decoder.Rope(D, (1.0,) * (D // 2)), tie_embeddings=False,
                          moe=m)
    params = jodpo.init_params(model, jax.random.key(0), std=0.5)
    p = jax.tree.map(lambda a: a[0], params["layers"]["moe"])
    return model, p


def _kernels_at_float32():
    """The megablox kernels' dots take no precision (a TPU's bf16 runs: exact in any mode); in Pallas' interpreter on
    a GPU they would run as TF32 (1e-3 off, seen on an H200), so the float32 tests ask for float32 products there
    (the paths that carry the model's precision themselves are run without it)."""
    return jax.default_matmul_precision("float32")


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_the_one_hot_reference_values_and_gradients(tokens):
    """The CPU's tiles (one row a tile at 1 token, experts left empty, several tiles for one expert at 40 tokens),
    ragged_dot (GPUs': jax's CPU version is slow but exact) and the TPU's megablox kernels (in Pallas' interpreter)
    against every token through every expert."""
    model, p = _tiny_block(shared=4)
    x = jax.random.normal(jax.random.key(1), (1, tokens, model.hidden_size))

    def loss(experts, p, x):
        y, _ = moe.block(model, p, x, experts)
        return jnp.sum(jnp.sin(y)), y

    ragged = functools.partial(moe.sorted_experts, grouped=moe.grouped_ragged)
    tiles = functools.partial(moe.sorted_experts, grouped=moe.grouped_tiles)
    megablox = functools.partial(moe.sorted_experts, grouped=functools.partial(moe.grouped_megablox, interpret=True))

    (_, want), want_grads = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(moe.dense_experts, p, x)
    for name, experts in (("tiles", tiles), ("ragged_dot", ragged), ("megablox", megablox)):
        with _kernels_at_float32() if name == "megablox" else contextlib.nullcontext():
            (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)(
                experts, p, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_tpu_kernels_leave_the_rows_of_no_expert_here_zero_with_zero_gradients():
    """Under an expert axis the rows routed to another device's experts sort past the groups: the megablox kernels
    never visit them (their outputs and the rows' gradients are whatever memory held: NaN in the interpreter), so
    grouped_megablox masks them, as grouped_ragged's are: zero values, zero gradients, the rest equal."""
    model, p = _tiny_block()
    sizes = jnp.asarray([5, 0, 7, 3, 2], jnp.int32)  # the 5 experts
    x = jax.random.normal(jax.random.key(3), (23, model.hidden_size))  # 17 rows in groups, 6 past them

    def run(grouped):
        f = lambda p, x: grouped(model, p, x, sizes)  # noqa: E731
        y, vjp = jax.vjp(f, p, x)
        return y, vjp(jnp.cos(y))

    with _kernels_at_float32():
        y, (dp, dx) = run(functools.partial(moe.grouped_megablox, interpret=True))
    want, (want_dp, want_dx) = run(moe.grouped_ragged)
    assert np.all(np.asarray(y)[17:] == 0) and np.all(np.asarray(dx)[17:] == 0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves((dp, dx)), jax.tree.leaves((want_dp, want_dx))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_tpu_kernels_lower_where_a_width_is_no_multiple_of_128():
    """A TPU block is a multiple of 128 or the whole dimension. The backward's products swap the forward's contracted
    and output dimensions, so each product gets its own tiles: with one tuple for all, an expert width of 192 (Gemma 4
    26B-A4B's 704) became the block of the 640-wide hidden dimension in the rows' gradient, and the step did not lower
    for a TPU (exported here for one, compiled nowhere)."""
    model, _ = _tiny_block(E=4, D=640, F=192)
    p = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in (("gate", (4, 640, 192)), ("up", (4, 640, 192)),
                                                                ("down", (4, 192, 640)))}
    x = jax.ShapeDtypeStruct((16, 640), jnp.bfloat16)
    loss = lambda p, x: jnp.sum(moe.grouped_megablox(model, p, x, jnp.full(4, 4, jnp.int32)).astype(jnp.float32))
    text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["tpu"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("tpu_custom_call")])(p, x).mlir_module()
    assert text.count("tpu_custom_call") >= 3  # gmm forward, gmm and tgmm backward


def test_a_gpu_runs_ragged_dot_for_few_rows_and_the_tiles_for_many():
    """XLA:GPU's ragged_dot multiplies every row by every expert's weights: a GPU program takes it up to
    GPU_RAGGED_ROWS rows (tokens x k) and the tiles' loop above (the program exported for CUDA, compiled nowhere)."""
    model, p = _tiny_block(k=2)
    f = jax.jit(lambda p, x: moe.block(model, p, x)[0])
    for tokens, ragged in ((moe.GPU_RAGGED_ROWS // 2, True), (moe.GPU_RAGGED_ROWS // 2 + 1, False)):
        x = jax.ShapeDtypeStruct((1, tokens, model.hidden_size), jnp.bfloat16)
        text = jax.export.export(f, platforms=["cuda"])(p, x).mlir_module()
        assert ("chlo.ragged_dot" in text, "stablehlo.while" in text) == (ragged, not ragged), tokens


@pytest.mark.parametrize("tile", [None, 8])
def test_a_decode_step_runs_only_the_tiles_of_the_chosen_experts(tile, monkeypatch):
    """Eight tokens choosing 2 of 64 experts, here four of them: the CPU's tiles of one row (a decode step's experts get
    a row or two), 16 of them, each of a chosen expert; or tiles of 8 rows, four of them hold rows, of the 58 a split
    of 16 rows could need: the loop stops at the last of them and never visits the others, so the step reads only the
    chosen experts' weights (each once a tile)."""
    model, p = _tiny_block(E=64, k=2)
    M, E = 16, 64
    if tile:
        monkeypatch.setattr(moe, "cpu_tile", lambda rows, experts: tile)
    sizes = np.zeros(E, np.int32)
    sizes[[3, 9, 10, 40]] = [5, 4, 4, 3]
    ran = []
    real_einsum = moe.einsum
    try:  # each tile that runs makes three products with its expert's weights (gate, up, down)
        moe.einsum = lambda model, spec, *ops, **kw: (jax.debug.callback(lambda: ran.append(spec)),
                                                      real_einsum(model, spec, *ops, **kw))[1]
        x = jax.random.normal(jax.random.key(2), (M, model.hidden_size))
        jax.block_until_ready(moe.grouped_tiles(model, p, x, jnp.asarray(sizes)))
    finally:
        moe.einsum = real_einsum
    assert moe.cpu_tile(M, E) == (tile or 1) and len(ran) == (4 if tile else 16) * 3


def test_fused_expert_tensors_load_as_the_per_expert_ones(checkpoints):
    """transformers 5 holds experts fused in memory (experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F]), as
    some hub checkpoints store them: a model object loads as its saved directory does."""
    path = checkpoints["qwen3_moe"]["causal_lm"]
    hf = _hf(path)
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    _, from_dir = jodpo.load_model(str(path))
    _, from_object = jodpo.load_model(hf)
    for a, b in zip(jax.tree.leaves(from_dir), jax.tree.leaves(from_object)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family,change,field", [
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
])
def test_moe_settings_jodpo_cannot_honour_are_refused_naming_the_field(checkpoints, tmp_path, family, change, field):
    cfg = AutoConfig.from_pretrained(checkpoints[family]["causal_lm"])
    for key, value in change.items():
        setattr(cfg, key, value)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=field) as e:
        jodpo.models.loading.describe_model(str(tmp_path))
    assert "\n" not in str(e.value)


def test_dense_layers_among_the_sparse_ones_equal_transformers_and_replay_their_routes(checkpoints, tmp_path):
    """Qwen3-MoE with mlp_only_layers (layers 0 and 3 a dense MLP of intermediate_size, the others experts: a scan of
    (dense, sparse, sparse) x 2): logits, the sparse layers' router logits and chosen experts (transformers records
    none for the dense ones), greedy decoding, the export tensor for tensor; each token forced to the experts its own
    routers chose (one route per sparse layer) gives the same logits."""
    cfg = AutoConfig.from_pretrained(checkpoints["qwen3_moe"]["causal_lm"])
    cfg.num_hidden_layers, cfg.mlp_only_layers = 6, [0, 3]
    torch.manual_seed(5)
    hf = hf_fixtures.randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)).eval()
    hf.save_pretrained(tmp_path / "dense")
    model, params = jodpo.load_model(str(tmp_path / "dense"))
    assert model.ffns == ("mlp", "moe", "moe") * 2 and model.mlp.width == cfg.intermediate_size
    assert [(r.period, r.reps) for r in decoder.layer_runs(tuple(map(decoder.layer_key, [model] * 6, range(6))))] == [
        ((("attention", "mlp"), ("attention", "moe"), ("attention", "moe")), 2)]
    helpers.assert_equals_transformers(model, params, hf, seed=6, router="logits", new_tokens=4)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(7), [9, 4], model.pad_token_id, "left")
    h, _, routing = decoder.hidden_states(model, params, ids, mask, with_router=True)
    assert routing.experts.shape[0] == 4
    forced, _ = decoder.hidden_states(model, params, ids, mask, routes=routing.experts)
    np.testing.assert_allclose(forced, h, rtol=1e-6, atol=1e-6)
    jodpo.save_hf(model, params, tmp_path / "export")
    back = _hf(tmp_path / "export").state_dict()
    for k, v in hf.state_dict().items():
        np.testing.assert_array_equal(back[k].numpy(), v.numpy(), err_msg=k)
    # LoRA all-linear as PEFT adapts it: the experts and routers of the sparse layers, never the dense layers' MLP
    # (PEFT turns gate_proj, up_proj, down_proj into the experts' target_parameters)
    adapted = model.replace(lora_rank=2, lora_alpha=4.0)
    names = lora.resolve_targets(adapted, ["all-linear"])
    adapters = lora.init_adapters(adapted, names, jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), adapters)
    assert set(adapters) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj@moe", "down_proj@moe",
                             "gate.weight@moe"}
    lora.save_peft(adapted, adapters, tmp_path / "adapter", names, 0.0, str(tmp_path / "dense"))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(8), [9, 4], model.pad_token_id, "right")
    ours = np.asarray(jodpo.logits(adapted, lora.attach(params, adapters), ids, mask))[mask > 0]
    theirs = references.peft_logits(tmp_path / "dense", tmp_path / "adapter", ids, mask)[mask > 0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


def test_the_loss_adds_transformers_aux_loss_of_the_policy_forward_times_the_coefficient(checkpoints):
    """Online DPO's loss with router_aux_loss_coef: the policy's load-balancing loss over the real tokens of every
    prompt + completion row (each prompt computed once, counted once per row, as transformers' forward of the rows)
    times the coefficient, logged as aux_loss; its gradient reaches the routers. Off (0), nothing is added or logged."""
    from jodpo.losses import LossConfig, OnlineBatch, online_batch_loss

    path = checkpoints["qwen3_moe"]["causal_lm"]
    model, params = jodpo.load_model(str(path))
    rng = np.random.default_rng(4)
    prompt, pmask = hf_fixtures.padded_batch(rng, [6, 3], model.pad_token_id, "left")
    completion, cmask = hf_fixtures.padded_batch(rng, [4, 2, 3, 4], model.pad_token_id, "right")
    batch = OnlineBatch(*map(jnp.asarray, (prompt, pmask, completion, cmask)), jnp.asarray([1.0, 0.0, 0.5, 2.0]))
    loss = jax.jit(online_batch_loss, static_argnums=(0, 5))
    off, m_off = loss(model, params, params, batch, 0.1, LossConfig())
    on, m_on = loss(model, params, params, batch, 0.1, LossConfig(router_aux_loss_coef=0.25))
    ids = np.concatenate([np.concatenate([prompt] * 2), completion], 1)
    mask = np.concatenate([np.concatenate([pmask] * 2), cmask], 1)
    hf = _hf(path, output_router_logits=True)
    with torch.no_grad():
        aux = float(hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).aux_loss)
    assert "aux_loss" not in m_off
    np.testing.assert_allclose(float(m_on["aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(on), float(off) + 0.25 * aux, rtol=1e-5)
    np.testing.assert_allclose(float(m_on["loss"]), float(on), rtol=1e-6)
    grads = jax.grad(
        lambda p, c: online_batch_loss(model, p, params, batch, 0.1, LossConfig(router_aux_loss_coef=c))[0])
    router = lambda g: np.asarray(g["layers"]["moe"]["router"])  # noqa: E731
    assert np.abs(router(grads(params, 0.25)) - router(grads(params, 0.0))).max() > 1e-6


@pytest.fixture(scope="module")
def gemma4_moe(checkpoints, tmp_path_factory):
    """The tiny Gemma 4 26B-A4B of tests/hf_fixtures.py (a causal LM and a reward model), built once for this module."""
    return hf_fixtures.build_moe_extra("gemma4_moe", tmp_path_factory.mktemp("gemma4_moe"),
                                       checkpoints["gemma4"]["causal_lm"])


def test_gemma4_moe_logits_routing_and_greedy_decoding_equal_transformers(gemma4_moe):
    """Gemma 4 26B-A4B's layers (experts beside the dense MLP, each between norms of its own; its router: a scale-free
    norm of the residual stream, a scale, a scale per expert) on left-padded prompts: the logits; each layer's router
    probabilities (what transformers' output_router_logits records for Gemma 4) and chosen experts; greedy decoding
    against generate (a prefill, then decode steps through the experts' tiles)."""
    path = gemma4_moe["causal_lm"]
    model, params = jodpo.load_model(str(path))
    assert model.mlp is not None and model.moe.router_norm
    helpers.assert_equals_transformers(model, params, _hf(path), router="probs")


def test_gemma4_moe_trains_three_steps_and_exports_to_transformers(gemma4_moe, tmp_path, capsys):
    """``python -m jodpo.train`` (its main) for 3 steps of the tiny Gemma 4 26B-A4B, its export (the experts fused as
    transformers holds them) read back by transformers to the same logits; router_aux_loss_coef is refused in one line
    (transformers computes no load-balancing loss for Gemma 4)."""
    from jodpo import train

    fields = dict(model_name_or_path=gemma4_moe["causal_lm"], reward_model_path=gemma4_moe["reward"],
                  dataset_name=hf_fixtures.prompt_dataset(tmp_path / "data"), output_dir=tmp_path / "run",
                  max_steps=3, save_steps=3, per_device_train_batch_size=2, max_new_tokens=4, max_length=96,
                  max_prompt_length=64, learning_rate=1e-2, bf16=False, logging_steps=1)
    argv = lambda **more: [f"--config.{k}={v}" for k, v in (fields | more).items()]  # noqa: E731
    assert train.main(argv(router_aux_loss_coef=0.01, output_dir=tmp_path / "refused")) != 0
    assert "router_aux_loss_coef=0.01: transformers computes no load-balancing loss" in capsys.readouterr().err
    assert train.main(argv()) == 0
    out, checks = helpers.export_hf.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert "bitwise" in checks[0] and "transformers" in checks[1]
    model, trained = jodpo.load_model(str(out))
    _, initial = jodpo.load_model(str(gemma4_moe["causal_lm"]))
    moe_moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial["layers"]["moe"]),
                                                             jax.tree.leaves(trained["layers"]["moe"]))]
    assert all(moe_moved), moe_moved  # the router, its scales, the experts and their norms all trained
    hf = _hf(out)
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(1), [5, 9], model.pad_token_id, "left")
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()[mask > 0]
    ours = np.asarray(jodpo.logits(model, trained, ids, mask))[mask > 0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


def test_qwen3_next_logits_routing_decoding_and_export_equal_transformers(checkpoints, tmp_path):
    """The tiny Qwen3-Next (DeltaNet's fused in_proj_qkvz / in_proj_ba split per key head's group, experts not
    renormalised, the gated shared expert): logits on left-padded prompts, each layer's router logits and chosen
    experts, greedy decoding against generate, and an export (the projections fused again) that transformers reads
    back to the same logits."""
    path = hf_fixtures.build_moe_extra("qwen3_next", tmp_path, checkpoints["qwen3_5_moe"]["causal_lm"])["causal_lm"]
    model, params = jodpo.load_model(str(path))
    assert model.family == "qwen3_next" and not model.moe.norm_topk_prob and model.moe.shared_dim == 48
    assert model.ffns == ("mlp", "moe") * 2
    hf = _hf(path)
    helpers.assert_equals_transformers(model, params, hf, seed=2, router="logits")
    jodpo.save_hf(model, params, tmp_path / "export")
    back = {k: v.numpy() for k, v in _hf(tmp_path / "export").state_dict().items()}
    for k, v in hf.state_dict().items():  # every tensor as it was: the fused projections' groups put back in place
        np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)

"""The gated delta rule (jodpo.models.delta_rule): the chunked form equals the recurrence and a token-by-token numpy
loop, both equal transformers' Qwen3-Next functions, the chunked form's recomputing backward equals autodiff of the
recurrence, padding (ragged rows) changes nothing, the recomputing backward holds less than autodiff would, the
rows taken in turn equal the rows at once, and prefixes with their continuations in one pass equal two calls.

Shapes are tiny and few (each is a compile): the functions are jitted once here and the cases share shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodpo.models.delta_rule import (chunked_delta_rule, chunked_delta_rule_autodiff, join_rows, joined_delta_rule,
                                     prefixed_delta_rule, recurrent_delta_rule, split_rows)

B, HK, DK, DV = 2, 2, 8, 6
recurrent = jax.jit(recurrent_delta_rule)
chunked = jax.jit(chunked_delta_rule, static_argnames="chunk")


def inputs(T: int, G: int, seed: int = 0, state: bool = True, Bs: int = B) -> list[np.ndarray]:
    """q (L2-normalised, scaled by Dk**-0.5), k (L2-normalised), v, g (<= 0), beta in (0, 1), a state or None."""
    rng = np.random.default_rng(seed)
    l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = l2(rng.normal(size=(Bs, T, HK, DK))) * DK ** -0.5
    k = l2(rng.normal(size=(Bs, T, HK, DK)))
    v = rng.normal(size=(Bs, T, HK * G, DV))
    g = -rng.uniform(0.02, 1.5, (Bs, T, HK * G))
    beta = rng.uniform(0.05, 1.0, (Bs, T, HK * G))
    S = rng.normal(size=(Bs, HK * G, DK, DV)) if state else None
    return [None if x is None else x.astype(np.float32) for x in (q, k, v, g, beta, S)]


def numpy_delta_rule(q, k, v, g, beta, S=None):
    """The recurrence as its definition reads, in float64, one token and one value head at a time."""
    Bs, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    S = np.zeros((Bs, Hv, Dk, Dv)) if S is None else S.astype(np.float64).copy()
    out = np.zeros((Bs, T, Hv, Dv))
    for b in range(Bs):
        for h in range(Hv):
            kh = h // (Hv // Hk)  # consecutive value heads share a key head
            for t in range(T):
                S[b, h] *= np.exp(g[b, t, h])
                delta = (v[b, t, h] - k[b, t, kh] @ S[b, h]) * beta[b, t, h]
                S[b, h] += np.outer(k[b, t, kh], delta)
                out[b, t, h] = q[b, t, kh] @ S[b, h]
    return out, S


def assert_close(got, want, rtol=2e-5, name=""):
    """Equal to float32 rounding, relative to the largest entry (outputs are sums over the sequence)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max(), err_msg=name)


# (T, chunk, G, initial state): T not a multiple of the chunk, T below it, several chunks; Hv = Hk, 2 Hk, 4 Hk
CASES = [(13, 4, 1, True), (5, 8, 2, False), (19, 4, 4, True)]


@pytest.mark.parametrize("T, C, G, state", CASES)
def test_chunked_equals_the_recurrence_and_its_definition(T, C, G, state):
    x = inputs(T, G, state=state)
    out_r, S_r = recurrent(*x)
    out_c, S_c = chunked(*x, chunk=C)
    assert out_c.dtype == S_c.dtype == jnp.float32 and S_c.shape == (B, HK * G, DK, DV)
    want_out, want_S = numpy_delta_rule(*x)
    for got_out, got_S in ((out_r, S_r), (out_c, S_c)):
        assert_close(got_out, want_out)
        assert_close(got_S, want_S)
    assert_close(out_c, out_r)
    assert_close(S_c, S_r)


def test_one_token_decode_step_reads_bf16_and_continues_the_state():
    """T = 1 (the sampler's step, no scan) from bf16 inputs: the float32 recurrence on the bf16 values, continuing
    from the state a chunked prefill left."""
    x = inputs(6, 2, seed=3)
    _, S = chunked(*[a[:, :5] for a in x[:5]], x[5], chunk=4)
    step = [jnp.asarray(a[:, 5:], jnp.bfloat16) for a in x[:5]]
    out, S1 = recurrent(*step, S)
    assert out.dtype == S1.dtype == jnp.float32 and out.shape == (B, 1, HK * 2, DV)
    want_out, want_S = numpy_delta_rule(*[np.asarray(a, np.float32) for a in x[:5]], x[5])
    # the state is as the float32 recurrence leaves it; the last token's inputs rounded to bf16 move its output
    np.testing.assert_allclose(np.asarray(out)[:, 0], want_out[:, 5], atol=2e-2 * np.abs(want_out[:, 5]).max())
    want_step = numpy_delta_rule(*[np.asarray(a.astype(jnp.float32)) for a in step], np.asarray(S))
    assert_close(out, want_step[0])
    assert_close(S1, want_step[1])
    assert np.abs(np.asarray(S1) - want_S).max() < 2e-2 * np.abs(want_S).max()
    out_c, S1_c = chunked(*step, S)  # one chunk of one token
    assert_close(out_c, out)
    assert_close(S1_c, S1)


@pytest.fixture(scope="module")
def transformers_delta_rule():
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return torch, qwen3_next


def test_equals_transformers(transformers_delta_rule):
    """transformers scales q by Dk**-0.5 itself (after its optional L2 norm, off here): it gets q unscaled."""
    torch, m = transformers_delta_rule
    T, C, G, _ = CASES[2]
    x = inputs(T, G)
    t = [torch.tensor(a) for a in x]
    t[0] = t[0] * DK ** 0.5
    kw = dict(initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=False)
    want_c = m.torch_chunk_gated_delta_rule(*t[:5], chunk_size=C, **kw)
    want_r = m.torch_recurrent_gated_delta_rule(*t[:5], **kw)
    for got in (recurrent(*x), chunked(*x, chunk=C)):
        for want in (want_c, want_r):
            assert_close(got[0], want[0].numpy())
            assert_close(got[1], want[1].numpy())


def loss(f):
    """A scalar of every output and the final state (weights so that no cotangent is uniform)."""
    def fn(q, k, v, g, beta, S):
        out, S1 = f(q, k, v, g, beta, S)
        w_out = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        w_S = jnp.sin(jnp.arange(S1.size, dtype=jnp.float32)).reshape(S1.shape)
        return (out * w_out).sum() + (out ** 2).sum() + (S1 * w_S).sum()
    return fn


ARGS = tuple(range(6))
grad_recurrent = jax.jit(jax.grad(loss(recurrent_delta_rule), argnums=ARGS))


@pytest.mark.parametrize("T, C, G, state", [CASES[0], CASES[2]])
def test_recomputing_backward_equals_autodiff_of_the_recurrence(T, C, G, state):
    x = inputs(T, G, seed=1, state=state)
    want = grad_recurrent(*x)
    got = jax.jit(jax.grad(loss(lambda *a: chunked_delta_rule(*a, chunk=C)), argnums=ARGS))(*x)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert np.abs(np.asarray(b)).max() > 0, name  # every input moves the loss
        assert_close(a, b, rtol=5e-5, name=name)


def test_left_and_right_padding_change_nothing():
    """Ragged rows: row 0 with 4 positions of padding before its 9 tokens, row 1 with 4 after (k = v = q = 0,
    beta = 0, g = 0), against each row's 9 tokens alone. Same shapes as CASES[0], so no new compile."""
    T, C, G, _ = CASES[0]
    real = inputs(9, G, seed=2)
    x = [np.zeros((B, T) + a.shape[2:], np.float32) for a in real[:5]]
    for a, r in zip(x, real):
        a[0, 4:], a[1, :9] = r[0], r[1]
    out, S = chunked(*x, real[5], chunk=C)
    out_r, S_r = recurrent(*x, real[5])
    want_out, want_S = numpy_delta_rule(*real)
    for got_out, got_S in ((out, S), (out_r, S_r)):
        assert_close(np.asarray(got_out)[0, 4:], want_out[0])
        assert_close(np.asarray(got_out)[1, :9], want_out[1])
        assert_close(got_S, want_S)


def test_recomputing_backward_keeps_less_than_autodiff():
    """XLA's temporaries of the gradient at T = 256 in chunks of 16 (C = D, so a chunk's C x C intermediates are the
    size of its state): autodiff through the chunk scan keeps every chunk's state and its intermediates (the decays,
    the writes, the system's inverse's levels) for the backward; the recomputing backward keeps the inputs, the
    state before each chunk and each chunk's inverse (C x C a value head), beside arrays the size of the inputs (a
    group's terms, computed for its chunks at once; the inputs' cotangents) and one chunk's intermediates at a time."""
    Bs, T, H, D, C = 1, 256, 2, 16, 16
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    args = (sd(Bs, T, H, D), sd(Bs, T, H, D), sd(Bs, T, H, D), sd(Bs, T, H), sd(Bs, T, H), sd(Bs, H, D, D))

    def temp_bytes(f):
        grad = jax.jit(jax.grad(loss(lambda *a: f(*a, chunk=C)), argnums=ARGS))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    ours, autodiff = temp_bytes(chunked_delta_rule), temp_bytes(chunked_delta_rule_autodiff)
    inputs_bytes = 4 * (3 * Bs * T * H * D + 2 * Bs * T * H + Bs * H * D * D)
    states_bytes = 4 * (T // C) * Bs * H * D * D
    squares_bytes = 4 * Bs * T * C * H  # one C x C matrix a chunk and value head
    assert ours <= 3 * (inputs_bytes + states_bytes + squares_bytes), (ours, inputs_bytes, states_bytes)  # 2.0x
    assert 2 * ours < autodiff, (ours, autodiff)  # measured: 2.7x


def test_the_chunk_scan_holds_only_the_dots_that_read_or_write_the_state():
    """Issue 60: the work that does not depend on the state (the decays, k k^T, the triangular system's inverse, U and
    W, q k^T) runs for a group's chunks at once before the sequential scan through them; its body is the four dots
    that read or write the state (the writes U - W S, the reads q S, the chunk's own writes read through P, the
    state's update). Five chunks in groups of 2: three groups, a scan over them around the chunk scan."""
    T, C, G, _ = CASES[2]
    jaxpr = jax.make_jaxpr(lambda *a: chunked_delta_rule(*a, chunk=C, group=2))(*inputs(T, G)).jaxpr

    def scans(j):
        for e in j.eqns:
            if e.primitive.name == "scan":
                yield e
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    yield from scans(getattr(inner, "jaxpr", inner))

    groups, chunk_scan = list(scans(jaxpr))
    assert groups.params["length"] == 3 and chunk_scan.params["length"] == 2
    dots = [e for e in chunk_scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 4, [str(e) for e in dots]


def test_any_group_and_one_row_equal_the_default():
    """The chunks a group at a time (1, 2: T padded to whole groups) and one row alone (no row axis inside) give the
    outputs, state and gradient of the default; float32 roundings of differently batched matmuls apart."""
    T, C, G, _ = CASES[2]
    x = inputs(T, G, seed=3)
    way = lambda **kw: jax.jit(jax.value_and_grad(loss(lambda *a: chunked_delta_rule(*a, chunk=C, **kw)),  # noqa: E731
                                                  argnums=ARGS))
    want_loss, want = way()(*x)
    for group in (1, 2):
        got_loss, got = way(group=group)(*x)
        assert_close(got_loss, want_loss, rtol=2e-6)
        for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
            assert_close(a, b, rtol=2e-6, name=f"group={group}: {name}")
    row = [a[:1] for a in x]
    for a, b in zip(jax.jit(lambda *a: chunked_delta_rule(*a, chunk=C))(*row), chunked(*x, chunk=C)):
        assert_close(a, np.asarray(b)[:1], rtol=2e-6)
    with pytest.raises(ValueError, match="group=0 must be at least 1"):
        chunked_delta_rule(*x, chunk=C, group=0)
    _, got = way()(*row)
    _, want = way()(*[np.concatenate([a[:1], np.zeros_like(a[1:])]) for a in x])  # row 1 adds nothing to row 0's
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert_close(a, np.asarray(b)[:1], rtol=2e-6, name=f"one row: {name}")


def test_rows_in_turn_equal_rows_at_once():
    """``rows_in_turn``: the rows two at a time (as on two devices) in a loop around the chunk scan: the same outputs,
    state and gradient as all rows at once (the same operations, batched otherwise: a few float32 roundings)."""
    T, C, G, _ = CASES[2]
    x = inputs(T, G, seed=2, Bs=4)
    way = lambda turn: lambda *a: chunked_delta_rule(*a, chunk=C, row_parts=2, rows_in_turn=turn)  # noqa: E731
    loops = [jax.jit(way(t)).lower(*x).as_text().count("stablehlo.while") for t in (False, True)]
    assert loops[1] == loops[0] + 1, loops  # (the groups' and chunks' scans, and the rows' loop around them)
    for a, b in zip(jax.jit(way(True))(*x), jax.jit(way(False))(*x)):
        assert_close(a, b, rtol=2e-6)
    grads = [jax.jit(jax.grad(loss(way(t)), argnums=ARGS))(*x) for t in (False, True)]
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), *grads):
        assert_close(a, b, rtol=2e-6, name=name)
    with pytest.raises(ValueError, match="row_parts=3 does not divide the 4 rows"):
        chunked_delta_rule(*x, chunk=C, row_parts=3, rows_in_turn=True)


def test_prefixes_and_their_continuations_in_one_pass_equal_two_calls():
    """``prefixed_delta_rule`` (``joined_delta_rule`` of ``join_rows``): 2 prefixes of 13 tokens and 2 continuations
    of each (5 tokens, block layout), in chunks of 4, groups of 2 (the continuations start mid-group, and the second
    continuation after a chunk's padding): the outputs, the prefixes' last state and every input's gradient equal the
    prefixes' ``chunked_delta_rule`` from zero, then the continuations' from those states; the program holds one copy
    of the rule (one custom VJP), not two. ``split_rows`` undoes ``join_rows``."""
    T, C, G, _ = CASES[0]
    prefix, suffix = inputs(T, G, seed=4)[:5], inputs(5, G, seed=5, Bs=2 * B)[:5]

    def two_calls(prefix, suffix):
        out_p, S = chunked_delta_rule(*prefix, chunk=C)
        return out_p, chunked_delta_rule(*suffix, jnp.concatenate([S, S]), chunk=C)[0], S

    def one_pass(prefix, suffix):
        return prefixed_delta_rule(prefix, suffix, chunk=C, group=2)

    want, got = jax.jit(two_calls)(prefix, suffix), jax.jit(one_pass)(prefix, suffix)
    for name, a, b in zip(("prefix", "suffix", "state"), got, want):
        assert_close(a, b, rtol=2e-6, name=name)
    weights = [jnp.cos(jnp.arange(a.size, dtype=jnp.float32)).reshape(a.shape) for a in want]
    scalar = lambda f: lambda *a: sum(jnp.sum(o * w + o ** 2) for o, w in zip(f(*a), weights))  # noqa: E731
    grads = [jax.jit(jax.grad(scalar(f), argnums=(0, 1)))(prefix, suffix) for f in (one_pass, two_calls)]
    for (path, a), b in zip(jax.tree.leaves_with_path(grads[0]), jax.tree.leaves(grads[1])):
        assert np.abs(np.asarray(b)).max() > 0, path
        assert_close(a, b, rtol=5e-6, name=jax.tree_util.keystr(path))
    vjps = lambda f: str(jax.make_jaxpr(f)(prefix, suffix)).count("custom_vjp_call")  # noqa: E731
    assert vjps(one_pass) == 1 and vjps(two_calls) == 2
    with pytest.raises(ValueError, match="3 continuations of 5 tokens"):
        prefixed_delta_rule(prefix, [a[:3] for a in suffix])
    joined = join_rows(prefix[0], suffix[0])  # the layer's layout: each row its prefix, then its continuations
    assert joined.shape[1] == T + 2 * 5 and all(np.array_equal(a, b) for a, b in
                                                 zip(split_rows(joined, T, 2), (prefix[0], suffix[0])))
    with pytest.raises(ValueError, match="P=13 and n=3 continuations"):
        joined_delta_rule(*(join_rows(a, b) for a, b in zip(prefix, suffix)), T, 3)

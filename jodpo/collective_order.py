"""Collectives in program order where XLA:CPU and gloo need it: a job of several processes on CPUs.

XLA:CPU orders a program's collectives by when they *start*, not when they end: its executor readies the next
collective as soon as the op before it that holds collectives has been *launched* (a "scheduling" edge), and a loop
(``lax.scan``, ``lax.while_loop``) or a ``lax.cond`` is launched long before it ends whenever its body continues on
other threads. So a collective scheduled after a loop, but not fed by it, runs while the loop's own collectives are
still running. Between the devices of one process that is harmless (XLA matches collectives by their id). Between
processes XLA:CPU uses gloo, and its gloo communicator runs every collective of a device group over the same
connections with the same tag (0): two at once mix their messages, and the job dies with gloo's ``Received data size
doesn't match expected size`` (or, their sizes being equal, adds the wrong numbers). docs/troubleshooting.md shows it
happening.

``order_collectives(fn)`` makes the order a data dependence there: it evaluates ``fn``'s jaxpr equation by equation
and, after each loop or cond, has every later equation read its operands through that loop's *fence*: ``x * 1``,
``x + 0`` or ``x | False``, with the 1 and 0 computed from the loop's results so that XLA cannot fold them away. An op
after a loop then waits for the loop to end (XLA orders ops that share buffers by their completion), collectives
included; inside loop bodies and branches likewise. Every value is unchanged bit for bit (``-0.0``, ``inf`` and
``nan`` too); the price is one elementwise pass over each value read after a loop (fused into its reader where XLA
can), paid by multi-process jobs on CPUs alone. Elsewhere (one process, GPUs, TPUs) ``order_collectives(fn)`` calls
``fn``.

``jit`` is ``jax.jit`` of ``order_collectives(fn)``: every program jodpo compiles goes through it. Research code that
jits its own programs for such a job wraps its function the same way (docs/tpu.md).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

# The primitives XLA:CPU runs as a thunk that can end after it was launched (a while loop or a conditional)
CONTROL_FLOW = frozenset({"scan", "while", "cond"})
# The bodies (params holding a ClosedJaxpr) that XLA runs within the enclosing program, where loops need fences too
BODIES = {"jit": ("jaxpr",), "closed_call": ("call_jaxpr",), "custom_jvp_call": ("call_jaxpr",),
          "custom_vjp_call": ("call_jaxpr",), "scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr")}


def needed() -> bool:
    """Whether this process's programs need their collectives ordered: a job of several processes on CPUs."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def order_collectives(fn: Callable, static_argnums: int | Sequence[int] = (),
                      static_argnames: str | Sequence[str] = ()) -> Callable:
    """``fn`` with its collectives kept in program order where XLA:CPU needs it (the module's docstring), to be
    jitted; ``fn`` itself elsewhere. ``static_argnums``/``static_argnames``: the arguments that are not arrays,
    as ``jax.jit`` takes them."""
    nums = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)
    names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not needed():
            return fn(*args, **kwargs)
        arrays = ([a for i, a in enumerate(args) if i not in nums], {k: v for k, v in kwargs.items() if k not in names})

        def with_statics(positional, keywords):
            given = iter(positional)
            return fn(*(a if i in nums else next(given) for i, a in enumerate(args)),
                      **keywords, **{k: v for k, v in kwargs.items() if k in names})

        closed, out_shape = jax.make_jaxpr(with_statics, return_shape=True)(*arrays)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(arrays))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def jit(fn: Callable, **kwargs) -> Callable:
    """``jax.jit(order_collectives(fn), **kwargs)``: a program whose collectives keep their order in any job."""
    ordered = order_collectives(fn, kwargs.get("static_argnums", ()), kwargs.get("static_argnames", ()))
    return jax.jit(ordered, **kwargs)


class _Fence:
    """The 0 and 1 after a loop, computed from its results: whatever is combined with them waits for the loop.
    Its ops carry the name ``fence`` (in the jaxpr's name stack and XLA's op metadata)."""

    def __init__(self, outs: Sequence[Any]):
        with jax.named_scope("fence"):
            firsts = [lax.convert_element_type(lax.reshape(lax.slice(o, (0,) * o.ndim, (1,) * o.ndim), ()),
                                               jnp.float32)
                      for o in (_data(o) for o in outs if _is_array(o)) if o.size]
            s = functools.reduce(lax.add, firsts, jnp.float32(0))
            self.zero = jnp.where(jnp.isfinite(s), s, 0.0) * 0.0  # XLA keeps x * 0.0 (x could be inf or nan)
            self.one = self.zero + 1.0
        self.applied: dict[core.Var, Any] = {}

    def apply(self, x):
        with jax.named_scope("fence"):
            return self._apply(x)

    def _apply(self, x):
        if not _is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(self._apply(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.mul(x, lax.convert_element_type(self.one, x.dtype))  # x * 1 is x: -0.0, inf, nan too
        if x.dtype == jnp.bool_:
            return lax.bitwise_or(x, self.zero != 0)
        return lax.add(x, lax.convert_element_type(self.zero, x.dtype))


def _is_array(x) -> bool:
    return isinstance(getattr(x, "aval", None), core.ShapedArray) and x.dtype != jax.dtypes.float0


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _eval(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jax.core.eval_jaxpr`` with fences: after each loop or cond, every later equation reads its operands through
    that loop's fence (each operand once a fence); the bodies of equations are evaluated with their loops fenced."""
    env: dict[core.Var, Any] = {}
    waits: dict[core.Var, int] = {}  # how many fences a value already waits for
    fences: list[_Fence] = []

    def read(v):
        if isinstance(v, core.Literal):
            return v.val
        if waits[v] == len(fences):
            return env[v]
        fence = fences[-1]
        if v not in fence.applied:
            fence.applied[v] = fence.apply(env[v])
        return fence.applied[v]

    for v, x in [*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)]:
        env[v], waits[v] = x, 0
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = eqn.primitive.get_bind_params(_fenced_bodies(eqn))
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if eqn.primitive.name in CONTROL_FLOW:
            fences.append(_Fence(outs))
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v], waits[v] = x, len(fences)
    return [v.val if isinstance(v, core.Literal) else env[v] for v in jaxpr.outvars]


def _fenced_bodies(eqn: core.JaxprEqn) -> dict:
    """The equation's params, with every body that holds a loop evaluated by ``_eval``."""
    name, params = eqn.primitive.name, dict(eqn.params)
    if name == "cond":
        params["branches"] = tuple(_retrace(b) for b in params["branches"])
    elif name == "remat2":  # jax.checkpoint: an open jaxpr whose constants are operands
        params["jaxpr"] = _retrace(core.ClosedJaxpr(params["jaxpr"], ()), constants=False).jaxpr
    elif name in BODIES:
        params.update({key: _retrace(params[key]) for key in BODIES[name]})
    elif any(_holds_loop(p) for p in params.values()):
        raise NotImplementedError(f"jodpo cannot order the collectives of a '{name}' equation: its body holds a loop")
    return params  # other bodies (a scatter's combiner, a reduction's) are scalar functions, never loops


def _retrace(closed: core.ClosedJaxpr, constants: bool = True) -> core.ClosedJaxpr:
    """``closed`` evaluated by ``_eval`` and traced again with its own input types (weak types and shardings
    included); ``closed`` itself when it holds no loop."""
    if not _holds_loop(closed):
        return closed
    fun = lu.wrap_init(lambda *a: _eval(closed.jaxpr, closed.consts, a), debug_info=closed.jaxpr.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, closed.in_avals)
    if consts and not constants:
        raise NotImplementedError("a checkpointed body whose fences made constants")
    return core.ClosedJaxpr(jaxpr, consts)


def _holds_loop(p) -> bool:
    jaxpr = p.jaxpr if isinstance(p, core.ClosedJaxpr) else p
    return isinstance(jaxpr, core.Jaxpr) and any(
        e.primitive.name in CONTROL_FLOW or any(_holds_loop(q) for q in e.params.values()) or
        any(_holds_loop(q) for q in e.params.get("branches", ())) for e in jaxpr.eqns)

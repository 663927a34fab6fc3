"""How ``params["layers"]`` is laid out over the layers, for the decoder, parameters, LoRA and sharding.

Each subtree of ``params["layers"]`` is stacked on a leading axis over a set of layers (``subtree_layers``): what
every layer has (norms) over all of them; a mixer kind's parameters (``KEYS``: ``"attn"``, ``"deltanet"``, ...) over
the layers of that kind (``"attn"`` over the full and the sliding attention layers both); the dense MLP's (``"mlp"``)
over the layers whose feed-forward kind has one (``Model.ffns``; where some layers' MLPs are twice as wide, Gemma 4's
KV-sharing layers, theirs are ``"mlp_wide"``), the MoE block's (``"moe"``) over those with experts. LoRA adapters
(``"lora"``) follow the weights they adapt. The layers run as ``lax.scan``s over ``layer_runs``: a run repeats a period
of layer kinds (mixer and feed-forward: ``layer_key``), so one compiled body serves any depth.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jodpo.models import attention_mixer, deltanet, global_attention, sliding_attention
from jodpo.models.model import Model, Params, einsum
from jodpo.models.shared_kv import Reader

# mixer kind -> its module, and where its parameters sit in params["layers"] (the sliding kind's with the full one's:
# the same projections, stacked over the layers of both, in order)
MIXERS = {"attention": attention_mixer, "sliding_attention": sliding_attention, "deltanet": deltanet,
          "global_attention": global_attention,
          "shared_sliding_attention": Reader("shared_sliding_attention", sliding_attention),
          "shared_global_attention": Reader("shared_global_attention", global_attention)}
KEYS = {"attention": "attn", "sliding_attention": "attn", "deltanet": "deltanet", "global_attention": "global_attn",
        "shared_sliding_attention": "shared_attn", "shared_global_attention": "shared_global_attn"}
KINDS_OF_KEY: dict[str, tuple[str, ...]] = {}
for _k, _key in KEYS.items():
    KINDS_OF_KEY[_key] = KINDS_OF_KEY.get(_key, ()) + (_k,)
# a weight LoRA can adapt -> the subtree of params["layers"] it sits in first (its home: a LoRA group of that module
# there is named by the module alone; elsewhere "module@subtree", lora.group_key)
SUBTREES: dict[str, str] = {}
for _k, _m in MIXERS.items():
    for _w in _m.WEIGHTS:
        SUBTREES.setdefault(_w, KEYS[_k])
SUBTREES |= {w: "mlp" for w in ("up", "gate", "down")} | {"ple_gate": "ple", "ple_proj": "ple", "shared_gate": "moe"}


def group_subtree(key: str, weight: str) -> str:
    """The subtree a LoRA group's weight sits in: ``"q_proj@global_attn"``'s in ``global_attn``, ``"q_proj"``'s in
    the weight's home (``SUBTREES``); a dotted one is nested (``"gate_proj@moe.shared"``: the MoE block's shared
    expert)."""
    return key.partition("@")[2] or SUBTREES[weight]


def subtree_layers(model: Model, key: str) -> tuple[int, ...]:
    """The layers a subtree of ``params["layers"]`` is stacked over, in order: a mixer kind's (``KEYS``) over the
    layers of its kinds, the dense MLP's over the layers whose feed-forward has one (``"mlp_wide"``: those of the
    ``wide_kinds``, ``"mlp"`` the others), the MoE block's over those with experts; the rest over every layer. A dotted
    key is its first part's (``"moe.shared"``)."""
    key = key.partition(".")[0]
    if key in KINDS_OF_KEY:
        return model.layers_of(*KINDS_OF_KEY[key])
    if key in ("mlp", "mlp_wide"):
        wide = set(model.layers_of(*model.wide_kinds))
        return tuple(i for i in model.layers_with("mlp") if (i in wide) == (key == "mlp_wide"))
    if key == "moe":
        return model.layers_with("moe")
    return tuple(range(model.num_layers))


def layer_key(model: Model, i: int, kind: str | None = None) -> tuple[str, str]:
    """What makes layer ``i`` a layer of its kind for the scans (``layer_runs``): its mixer kind (``kind`` where the
    caller scans another in its place) and its feed-forward kind."""
    return (kind or model.kinds[i], model.ffns[i])


def merge_adapters(model: Model, p: Params) -> Params:
    """Layer parameters (stacked ``[N, ...]`` or one layer's) with their LoRA adapters folded in:
    ``W + lora_alpha / lora_rank * a.b`` in float32, the adapters gone. ``p["lora"]`` maps a group (a HF module name,
    ``lora.group_key``) to ``{"a": [..., in..., r], "b": {weight: [..., r, out...]}}``; several weights sharing one
    ``a`` are a fused HF module (GPT-NeoX's ``query_key_value``, Qwen3.5's ``in_proj_qkv``, a gated ``q_proj``)."""
    if "lora" not in p:
        return p
    p = dict(p)
    scale = model.lora_alpha / model.lora_rank
    for key, group in p.pop("lora").items():
        a = group["a"]
        for name, b in group["b"].items():
            node = p
            for k in group_subtree(key, name).split("."):  # copied on the way down: the caller's dicts stay as they are
                node[k] = dict(node[k])
                node = node[k]
            w = node[name]
            lead = a.ndim + b.ndim - 2 - w.ndim  # the stacked layer axis, if any
            n_in = a.ndim - 1 - lead
            letters = "abcdefgh"
            L, i, o = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:lead + n_in + b.ndim - 1 - lead]
            delta = einsum(model, f"{L}{i}r,{L}r{o}->{L}{i}{o}", a.astype(jnp.float32), b.astype(jnp.float32))
            node[name] = w.astype(jnp.float32) + scale * delta
    return p


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers ``start .. start + reps * len(period)``: ``period`` (their kinds) repeated ``reps`` times."""

    start: int
    period: tuple[str, ...]
    reps: int

    @property
    def end(self) -> int:
        return self.start + self.reps * len(self.period)


def _repeating(rest: tuple[str, ...]) -> Run | None:
    """The period (shortest first) that covers the most of ``rest``'s first layers by repeating at least twice."""
    best = None
    for p in range(1, len(rest) // 2 + 1):
        reps = 1
        while rest[reps * p:(reps + 1) * p] == rest[:p]:
            reps += 1
        if reps > 1 and (best is None or reps * p > best.reps * len(best.period)):
            best = Run(0, rest[:p], reps)
    return best


@functools.lru_cache(maxsize=None)
def layer_runs(kinds: tuple[str, ...]) -> tuple[Run, ...]:
    """The layers as scans over repeating periods: from the first layer on, the period that covers the most layers by
    repeating (shortest first), then the same for the layers after it. Layers where no period repeats (until one
    does) are a run of their own, once. A uniform model is one run of one layer; Qwen3.5's 24 layers one run of
    (deltanet x 3, attention) x 6; Gemma 4 E2B's 35 two runs: (sliding x 4, global) x 3, then its KV-sharing layers'
    (sliding x 4, global) x 4. Inside a period, consecutive layers of one kind are a scan of their own
    (``groups``)."""
    runs, start = [], 0
    while start < len(kinds):
        found = _repeating(kinds[start:])
        if found is not None:
            runs.append(Run(start, found.period, found.reps))
            start = runs[-1].end
            continue
        end = next((i for i in range(start + 1, len(kinds)) if _repeating(kinds[i:]) is not None), len(kinds))
        runs.append(Run(start, kinds[start:end], 1))
        start = end
    return tuple(runs)


@functools.lru_cache(maxsize=None)
def groups(period: tuple[str, ...]) -> tuple[tuple[int, str, int], ...]:
    """A period's layers as ``(first, kind, count)``: consecutive layers of one kind together. Each group of several
    runs as a ``lax.scan`` of one layer, so that rematerialising a layer saves inside a period what it saves in a
    scan of single layers (in straight-line code XLA keeps every layer's recomputed activations at once)."""
    out, q = [], 0
    while q < len(period):
        n = 1
        while q + n < len(period) and period[q + n] == period[q]:
            n += 1
        out.append((q, period[q], n))
        q += n
    return tuple(out)


def _leaf_layers(model: Model, layers: Params) -> dict:
    """For each subtree of ``params["layers"]``: the layers it is stacked over (``subtree_layers``). A LoRA group
    follows the weights it adapts."""
    out = {}
    for key, sub in layers.items():
        if key == "lora":
            out[key] = {g: subtree_layers(model, group_subtree(g, next(iter(ad["b"])))) for g, ad in sub.items()}
        else:
            out[key] = subtree_layers(model, key)
    return out


def map_layers(model: Model, layers: Params, fn) -> Params:
    """``fn(leaf, stacked)`` on every leaf of ``params["layers"]``, ``stacked`` the layers it is stacked over."""
    which = _leaf_layers(model, layers)
    out = {}
    for key, sub in layers.items():
        if key == "lora":
            out[key] = {g: jax.tree.map(lambda x, k=which[key][g]: fn(x, k), ad) for g, ad in sub.items()}
        else:
            out[key] = jax.tree.map(lambda x, k=which[key]: fn(x, k), sub)
    return out


def for_layers(model: Model, layers: Params, among) -> Params:
    """The subtrees of ``params["layers"]`` that any of the layers ``among`` reads: what every layer has, their
    mixers', their feed-forwards', and the LoRA groups of any of them."""
    which, among = _leaf_layers(model, layers), set(among)
    mine = lambda stacked: bool(among & set(stacked))  # noqa: E731
    out = {k: v for k, v in layers.items() if k != "lora" and mine(which[k])}
    lora = {g: ad for g, ad in layers.get("lora", {}).items() if mine(which["lora"][g])}
    return out | ({"lora": lora} if lora else {})


def layer_params(model: Model, layers: Params, i: int) -> Params:
    """Layer ``i``'s own parameters out of stacked ``params["layers"]``: each subtree it reads at ``i``'s place among
    the layers that subtree is stacked over."""
    return map_layers(model, for_layers(model, layers, (i,)), lambda x, stacked: x[stacked.index(i)])


def _among(stacked: tuple[int, ...], first: int, count: int) -> int:
    """How many of layers ``first .. first + count - 1`` a subtree stacked over ``stacked`` has."""
    return sum(first <= i < first + count for i in stacked)


def run_params(model: Model, layers: Params, run: Run) -> Params:
    """The parameters a run's scan reads, each leaf ``[reps, its layers in a period, ...]``, or, where a period has one
    of its layers, ``[reps, ...]``: the stack as it is (a uniform model's whole stack, no copy, no unit axis), so its
    compiled program is a plain scan over the stack."""
    n = len(run.period)

    def take(leaf, stacked):
        start, count = _among(stacked, 0, run.start), _among(stacked, run.start, n)
        leaf = leaf[start:start + run.reps * count]
        return leaf if count == 1 else leaf.reshape(run.reps, count, *leaf.shape[1:])

    return map_layers(model, for_layers(model, layers, range(run.start, run.start + n)), take)


def period_params(model: Model, p_run: Params, run: Run, q: int, count: int = 1) -> Params:
    """Layer ``q`` of a run's period's parameters out of ``run_params``' slice for one repetition; with ``count``,
    layers ``q .. q + count - 1`` (of one kind: a ``groups`` entry), each leaf ``[count, ...]``."""
    first = run.start + q  # (in the first repetition: every repetition's layers have the same subtrees)

    def take(leaf, stacked):
        if _among(stacked, run.start, len(run.period)) == 1:
            return leaf
        at = _among(stacked, run.start, q)
        return leaf[at] if count == 1 else leaf[at:at + count]

    return map_layers(model, for_layers(model, p_run, (first,)), take)

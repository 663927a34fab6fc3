"""``Model``, the static architecture of a decoder, and ``einsum``, the one place its dots get their precision.

``Model`` is frozen and hashable (a valid ``static_argnums`` of ``jax.jit``) and holds no arrays; ``params`` is a
plain nested dict of arrays. The forwards that read both are in ``jodpo.models.decoder``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
Cache = dict[str, Any]
# The mixer kinds a layer can have (``Model.layer_kinds``): softmax attention over a KV cache; softmax attention over a
# sliding window (``Model.sliding_window``), whose cache is a ring of the window's slots; Gated DeltaNet (linear
# attention with a recurrent state); softmax attention of another shape (Gemma 4's global layers: ``Model.
# global_attention``); and the kinds that reuse the keys and values of another kind's last layer (KV sharing: Gemma 4's
# last layers) instead of projecting their own. Each owns its parameters, forwards and cache state
# (``jodpo.models.attention_mixer``, ``sliding_attention``, ``deltanet``, ``global_attention``, ``shared_kv``); the
# softmax-attention kinds compute with their ``Attention`` description (``Model.attention_of``).
KINDS = ("attention", "sliding_attention", "deltanet", "global_attention", "shared_sliding_attention",
         "shared_global_attention")
# KV sharing: a kind whose layers read the keys and values of the last layer of another kind before them
READS = {"shared_sliding_attention": "sliding_attention", "shared_global_attention": "global_attention"}
SLIDING = ("sliding_attention", "shared_sliding_attention")  # the kinds that attend over Model.sliding_window
# The feed-forward kinds a layer can have (``Model.ffn_kinds``): the dense MLP (``Model.mlp``, ``jodpo.models.mlp``),
# the mixture of experts (``Model.moe``, ``jodpo.models.moe``), or both side by side (Gemma 4 26B-A4B)
FFN_KINDS = ("mlp", "moe", "moe_and_mlp")


@dataclasses.dataclass(frozen=True)
class Norms:
    """A model's norms: which, how they scale, and where a layer has them (``Model.norms``)."""

    kind: str  # "layernorm" (a scale and a bias: NeoX) | "rmsnorm"
    eps: float
    # RMSNorm as x * (offset + w), the product in float32 before the cast back (Gemma, Qwen3.5: 1.0); 0.0 is Llama's
    # (normalise in float32, cast, then scale by w)
    offset: float = 0.0
    scale_f32: bool = False  # x * w in float32 before the cast back, as Gemma's with an offset 0 (OLMo 2, Gemma 4)
    # where a layer's norms sit: "pre", on the mixer's and the MLP's inputs (most families); "sandwich", on their
    # outputs too (Gemma's four a layer); "post", on their outputs only (OLMo 2 and 3)
    sites: str = "pre"

    def __post_init__(self):
        if self.kind not in ("layernorm", "rmsnorm") or self.sites not in NORM_SITES:
            raise ValueError(f"Norms: kind must be layernorm or rmsnorm and sites one of {NORM_SITES}, got "
                             f"{self.kind!r}, {self.sites!r}")

    @property
    def pre(self) -> bool:
        """The mixer's and the MLP's inputs are normed."""
        return self.sites != "post"

    @property
    def post(self) -> bool:
        """The mixer's and the MLP's outputs are normed, before their residuals."""
        return self.sites != "pre"


NORM_SITES = ("pre", "sandwich", "post")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How a softmax-attention layer forms its queries, keys and values and gates its output, beyond the projections
    every family has (``Attention.options``: ``Model.attn_options``, or Gemma 4's global layers' own)."""

    # an RMSNorm over the queries and keys after the projection, before RoPE: "" none; "head" over each head, one
    # scale per head dim shared by the heads (Qwen3, Gemma 3 and 4); "whole" over the whole q and k projections,
    # every head at once, a scale per channel (OLMo 2 and 3)
    qk_norm: str = ""
    v_norm: bool = False  # a scale-free RMSNorm over each head's values (Gemma 4)
    k_eq_v: bool = False  # no v projection: the values are the keys before their norm and RoPE (attention_k_eq_v)
    # q_proj also yields a gate per head: the attention's output times sigmoid(gate) before the output projection
    # (Qwen3.5's gated attention, Qwen3-Next)
    output_gate: bool = False

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")


QK_NORMS = ("", "head", "whole")


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embeddings (rotate-half, as transformers) of a model's attention layers (``Model.rope``; Gemma
    4's global layers have their own, ``Model.global_attention.rope``)."""

    rotary_dim: int  # the leading head dims that rotate (partial rotary: Pythia's quarter)
    # inverse frequencies, scaling (linear, llama3, YaRN) applied; zeros rotate nothing (Gemma 4's proportional RoPE)
    inv_freq: tuple[float, ...]
    # the sliding-window layers' own where they differ (Gemma 3's local base 10k beside its scaled global RoPE, OLMo
    # 3's plain base beside YaRN); () = every layer uses inv_freq
    local_inv_freq: tuple[float, ...] = ()
    scale: float = 1.0  # YaRN's attention factor: cos and sin of inv_freq's tables times this (OLMo 3); 1 = none
    nope_layers: tuple[int, ...] = ()  # the layers that rotate nothing (SmolLM3's NoPE layers, every 4th)


@dataclasses.dataclass(frozen=True)
class Attention:
    """What a softmax-attention mixer kind's layers compute with (``Model.attention_of``): their heads' shape, RoPE,
    options and window. The kinds ``attention`` and ``sliding_attention`` have the ``Model``'s fields (``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``rope``, ``attn_options``; the sliding kind ``sliding_window`` too); Gemma 4's
    ``global_attention`` layers have one of their own (``Model.global_attention``: ``global_head_dim``,
    ``num_global_key_value_heads``, ``attention_k_eq_v``, the "proportional" RoPE of ``rope_parameters
    ["full_attention"]``). What every attention layer shares (norms, the scores' scale and soft-cap, biases, the
    kernel, dtype and precision) stays the ``Model``'s."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    options: AttentionOptions = AttentionOptions()
    # a token attends to itself and the window - 1 slots before it, padding included, as transformers; 0 = to every
    # earlier slot. A windowed kind rotates with the local RoPE tables where its rope has them (Rope.local_inv_freq)
    window: int = 0


@dataclasses.dataclass(frozen=True)
class PerLayerEmbeddings:
    """Gemma 4's per-layer embeddings (E2B, E4B: ``hidden_size_per_layer_input``): a table of ``dim`` values per layer
    for each of ``vocab_size`` tokens, and a projection of the embeddings to the same, combined into each layer's
    input, which a gated projection adds to the layer's output."""

    dim: int
    vocab_size: int
    activation: str  # of the gated projection (transformers' hidden_act name: Gemma 4's hidden_activation)


@dataclasses.dataclass(frozen=True)
class DeltaNet:
    """The shape of a model's Gated DeltaNet layers (Qwen3.5, Qwen3-Next: ``linear_*`` fields of the config)."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: value head h reads query/key head h // (num_v_heads // num_k_heads)
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # the causal depthwise convolution's width over q, k and v

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of linear_num_key_heads "
                             f"({self.num_k_heads})")


@dataclasses.dataclass(frozen=True)
class MLP:
    """The dense feed-forward (``Model.mlp``; ``jodpo.models.mlp``): ``down(act(gate(x)) * up(x))`` where ``gated``
    (SwiGLU, GeGLU), ``down(act(up(x)))`` otherwise (GPT-NeoX), ``width`` wide, with biases where ``bias``. The layers
    of the mixer kinds in ``wide_kinds`` have MLPs twice as wide (Gemma 4's KV-sharing layers: use_double_wide_mlp)."""

    width: int
    activation: str  # transformers' hidden_act name (jodpo.models.layers.ACTIVATIONS)
    gated: bool = True
    bias: bool = False
    wide_kinds: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward (``Model.moe``; ``jodpo.models.moe``): a router over ``num_experts`` gated
    experts of width ``expert_dim`` and activation ``activation``, of which each token takes the ``top_k`` most
    probable (softmax in float32), their probabilities renormalised to sum to 1 where ``norm_topk_prob``; beside them,
    where ``shared_dim``, a shared expert of that width whose output is times sigmoid of a learned gate (Qwen3.5-MoE,
    Qwen3-Next). ``router_norm`` (Gemma 4): the router reads the layer's residual stream through a scale-free RMSNorm,
    times a learned scale and hidden_size^-1/2, and the chosen experts' weights are times a learned per-expert scale.
    A model with a dense MLP too (``Model.mlp``: Gemma 4 26B-A4B) runs both side by side, each between norms of its
    own, and adds their outputs."""

    num_experts: int
    top_k: int
    expert_dim: int
    norm_topk_prob: bool
    activation: str = "silu"  # transformers' hidden_act name
    shared_dim: int = 0
    router_norm: bool = False
    # transformers' forward has a load-balancing loss (aux_loss) for router_aux_loss_coef (Gemma 4's has none)
    aux_loss: bool = True

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and num_experts "
                             f"({self.num_experts})")


@dataclasses.dataclass(frozen=True)
class Model:
    """Static architecture of a decoder (and its head). Hashable; holds no arrays."""

    family: str  # a module of jodpo.models.families: "gpt_neox", "llama" (Mistral, SmolLM 1-2 too), "olmo2" (OLMo 3 too), ...
    task: str  # "causal_lm" (LM head) | "reward" (score head, num_labels=1)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # the dense feed-forward (width, activation, gating, biases, the wider layers); None: the experts alone (moe)
    mlp: MLP | None
    norms: Norms
    qkv_bias: bool
    out_bias: bool
    parallel_residual: bool
    rope: Rope
    tie_embeddings: bool
    # the sliding-window layers' window in slots (kinds SLIDING: a token attends to itself and the window - 1 slots
    # before it, padding included, as transformers); 0 = none
    sliding_window: int = 0
    attn_options: AttentionOptions = AttentionOptions()  # q/k norms, value norm, keys as values, output gate
    embed_scale: float = 1.0  # embeddings times this, rounded to the compute dtype (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # the scores' scale (Gemma: query_pre_attn_scalar**-0.5); None: head_dim**-0.5
    attn_softcap: float = 0.0  # attention scores soft-capped as cap * tanh(s / cap) (Gemma 2); 0 = off
    final_softcap: float = 0.0  # logits soft-capped likewise (Gemma 2); 0 = off
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # compute dtype; log-softmax and attention softmax stay in float32
    remat: str = "none"  # "none" | "full" | "dots": rematerialisation of the layer body
    # How float32 dots are computed (jax.lax.Precision names): "highest" is true float32 on every backend,
    # "high"/"default" let GPUs use TF32 and TPUs fewer bf16 passes. bfloat16 compute ignores it (see einsum).
    precision: str = "highest"
    # Attention of the cache-free forwards (training, scoring, reference) and the prefill: "xla" (jodpo's einsum
    # attention, any backend), "cudnn" (cuDNN flash attention through jax.nn.dot_product_attention: NVIDIA GPUs,
    # bf16/fp16 compute) or "splash" (splash attention, jodpo.models.splash: TPUs, bf16 compute; float32 compute runs
    # jodpo's own). cuDNN cannot soft-cap: a model with attn_softcap runs jodpo's own attention whatever this says
    # (attention_note).
    attention: str = "xla"
    # Attention of the decode steps over the cache (one new token a row): "xla" (jodpo's einsum attention over the
    # whole slab, any backend) or "pallas" (jodpo.models.decode_attention: a kernel that reads only the cache blocks
    # holding a slot the row attends to; Mosaic on TPUs, Pallas' interpret mode where lowered for another platform)
    decode_attention: str = "xla"
    # LoRA (jodpo.models.lora): adapters in params["layers"]["lora"], when there, add lora_alpha / lora_rank * a.b to
    # their weights (PEFT's scaling); params without them (the reference: the adapters off) run the base model.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    # Hybrid decoders: each layer's mixer kind (KINDS), () = every layer softmax attention; the DeltaNet layers' shape
    layer_kinds: tuple[str, ...] = ()
    deltanet: DeltaNet | None = None
    # Gemma 4: the global layers' attention (their heads' shape, RoPE and options; window 0); per-layer embeddings;
    # each layer's output times a learned scalar (layer_scalar)
    global_attention: Attention | None = None
    per_layer_embeddings: PerLayerEmbeddings | None = None
    layer_scalar: bool = False
    # Mixture of experts: the MoE block of the layers whose feed-forward kind has experts; None: the dense MLP alone
    moe: MoE | None = None
    # Each layer's feed-forward kind (FFN_KINDS); () = every layer the same: both side by side where the model has
    # both (Gemma 4 26B-A4B), else the one it has. Qwen3-MoE's and Qwen3-Next's dense layers among the sparse ones
    # (mlp_only_layers, decoder_sparse_step) are "mlp" beside "moe"
    ffn_kinds: tuple[str, ...] = ()
    # The source config.json (for export); not part of the identity of the compiled function.
    hf_config: str = dataclasses.field(default="{}", compare=False, repr=False)

    def __post_init__(self):
        try:
            jax.lax.Precision(self.precision)
        except ValueError:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}") from None
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got {self.decode_attention!r}")
        if self.layer_kinds and (len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - set(KINDS)):
            raise ValueError(f"layer_kinds must name one of {KINDS} for each of the {self.num_layers} layers, got "
                             f"{self.layer_kinds}")
        if self.mlp is None and self.moe is None:
            raise ValueError("a model needs a feed-forward: a dense MLP (Model.mlp), a mixture of experts (Model.moe) "
                             "or both")
        if self.ffn_kinds and (len(self.ffn_kinds) != self.num_layers or set(self.ffn_kinds) - set(FFN_KINDS)):
            raise ValueError(f"ffn_kinds must name one of {FFN_KINDS} for each of the {self.num_layers} layers, got "
                             f"{self.ffn_kinds}")
        needs = {"mlp": ("mlp",), "moe": ("moe",), "moe_and_mlp": ("mlp", "moe")}
        for kind in dict.fromkeys(self.ffns):
            missing = [f"Model.{f}" for f in needs[kind] if getattr(self, f) is None]
            if missing:
                raise ValueError(f"feed-forward kind {kind!r} needs {' and '.join(missing)}")
        if {"moe", "moe_and_mlp"} <= set(self.ffns):
            raise ValueError("a model's expert layers are all beside its dense MLP (moe_and_mlp) or none (moe), got "
                             f"both kinds in {self.ffns}")
        if self.mlp is not None and set(self.mlp.wide_kinds) - set(self.kinds):
            raise ValueError(f"MLP.wide_kinds {self.mlp.wide_kinds} must be mixer kinds of this model's layers "
                             f"{tuple(dict.fromkeys(self.kinds))}")
        if "deltanet" in self.layer_kinds and self.deltanet is None:
            raise ValueError("a model with deltanet layers needs their shape (Model.deltanet)")
        if bool(self.layers_of(*SLIDING)) != (self.sliding_window > 0):
            raise ValueError(f"a model has sliding_attention layers exactly when it has a sliding_window, got kinds "
                             f"{self.kinds} and a window of {self.sliding_window}")
        if "global_attention" in self.layer_kinds and self.global_attention is None:
            raise ValueError("a model with global_attention layers needs their description (Model.global_attention)")
        if self.global_attention is not None and self.global_attention.window:
            raise ValueError(f"Model.global_attention.window must be 0 (global layers attend to every earlier slot; a "
                             f"windowed kind is sliding_attention), got {self.global_attention.window}")
        for reader, source in READS.items():  # a reader reads the last layer of its source kind: all must come first
            if self.layers_of(reader) and not (self.layers_of(source) and
                                               self.layers_of(source)[-1] < self.layers_of(reader)[0]):
                raise ValueError(f"{reader} layers {self.layers_of(reader)} reuse the keys and values of the last "
                                 f"{source} layer before them; there is none (the {source} layers are "
                                 f"{self.layers_of(source)})")

    def replace(self, **changes) -> "Model":
        return dataclasses.replace(self, **changes)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's mixer kind."""
        return self.layer_kinds or ("attention",) * self.num_layers

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        """The indices of the layers of these mixer kinds, in order (a kind's parameters are stacked over these)."""
        return tuple(i for i, k in enumerate(self.kinds) if k in kinds)

    @property
    def ffns(self) -> tuple[str, ...]:
        """Each layer's feed-forward kind (``FFN_KINDS``)."""
        if self.ffn_kinds:
            return self.ffn_kinds
        one = ("moe_and_mlp" if self.mlp is not None else "moe") if self.moe is not None else "mlp"
        return (one,) * self.num_layers

    def layers_with(self, part: str) -> tuple[int, ...]:
        """The layers whose feed-forward has ``part``: ``"mlp"`` (the dense MLP, alone or beside experts) or ``"moe"``
        (experts; the MoE block's parameters and its routing are stacked over these)."""
        return tuple(i for i, f in enumerate(self.ffns) if part in f.split("_and_"))

    @property
    def wide_kinds(self) -> tuple[str, ...]:
        """The kinds whose layers' MLPs are twice as wide (``MLP.wide_kinds``: Gemma 4's KV-sharing layers)."""
        return () if self.mlp is None else self.mlp.wide_kinds

    def attention_of(self, kind: str) -> Attention:
        """The ``Attention`` description the layers of a softmax-attention mixer kind compute with (a KV-sharing
        kind's: the kind's it reads, ``READS``)."""
        kind = READS.get(kind, kind)
        if kind == "global_attention" and self.global_attention is not None:
            return self.global_attention
        if kind not in ("attention", "sliding_attention"):
            raise ValueError(f"attention_of: {kind!r} is not a softmax-attention kind of this model (kinds "
                             f"{tuple(dict.fromkeys(self.kinds))})")
        return Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.rope, self.attn_options,
                         self.sliding_window if kind in SLIDING else 0)


def attention_note(model: Model) -> str | None:
    """One line when ``model.attention`` asks for a kernel that cannot compute this model's attention (cuDNN's flash
    attention has no soft-capping), saying which path runs instead; None when the kernel can."""
    if model.attention == "cudnn" and model.attn_softcap:
        return (f"attn_implementation='cudnn' cannot soft-cap attention scores (this {model.family} model caps them at "
                f"{model.attn_softcap:g}): its attention runs on jodpo's own XLA path instead")
    return None


# jax's names for the precision of float32 dots; "highest" = "float32", "high" = "tensorfloat32" (TF32 on GPUs,
# 3 bf16 passes on TPUs), "default" = "bfloat16" = "fastest" (TF32 on GPUs, 1 bf16 pass on TPUs).
PRECISIONS = ("highest", "high", "default", "float32", "tensorfloat32", "bfloat16", "fastest")
ATTENTIONS = ("xla", "cudnn", "splash")
DECODE_ATTENTIONS = ("xla", "pallas")


def einsum(model: Model, spec: str, *operands: jax.Array, **kwargs) -> jax.Array:
    """``jnp.einsum`` under the model's precision policy: every dot of the models (so of the sampler, the
    scorers and the losses) goes through here. float32 operands get ``model.precision`` (``"highest"``: the
    same float32 products on a CPU, a GPU that would otherwise use TF32, and a TPU that would use one bf16
    pass); bfloat16 operands are exact in any mode and keep the backend's fast path."""
    f32 = any(jnp.dtype(op.dtype) == jnp.float32 for op in operands)
    precision = jax.lax.Precision(model.precision) if f32 else None
    return jnp.einsum(spec, *operands, precision=precision, **kwargs)

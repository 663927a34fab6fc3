"""KV sharing (Gemma 4's last ``num_kv_shared_layers`` layers): mixer kinds whose layers project queries only and attend
to the keys and values of the last layer of another kind before them (``model.READS``: ``shared_sliding_attention``
reads the last ``sliding_attention`` layer's, its ring; ``shared_global_attention`` the last ``global_attention``
layer's), with their source's window and RoPE. In the sampler's cache such a layer keeps no state: the decoder hands
it its source's (``decoder``'s state lookup), the same memory read twice, never a copy; in the cache-free forwards it
reads KV sharing's slot, which every layer of the source kind refills (so the last one before the readers is what they
read).

A ``Reader`` offers the decoder the functions of every mixer kind (``jodpo.models.attention_mixer`` lists them), as
its source kind's module computes them with ``reads=True``."""
from __future__ import annotations

from jodpo.models.model import READS, Model


class Reader:
    """The mixer kind of layers that read the keys and values of the last layer of kind ``source``, computed by that
    kind's module (``attention_mixer``, ``sliding_attention`` or ``global_attention``) with ``reads=True``."""

    WEIGHTS = ("q", "o", "o_gate")

    def __init__(self, kind: str, source_module):
        self.kind, self.source, self._m = kind, READS[kind], source_module

    def specs(self, model: Model, n: int) -> dict:
        return self._m.specs(model, n, reads=True)

    def init_state(self, model: Model, batch: int, length: int, dtype):
        return None  # it reads its source's

    def full(self, model: Model, p, x, ctx, site, kv=None):
        return self._m.full(model, p, x, ctx, site, kv, reads=True)

    def prefixed(self, model: Model, p, xs, ctx, site, kv=None):
        return self._m.prefixed(model, p, xs, ctx, site, kv, reads=True)

    def cached(self, model: Model, p, x, state, j, ctx, site):
        return self._m.cached(model, p, x, state, j, ctx, site, reads=True)

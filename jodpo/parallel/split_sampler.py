"""Sampling on devices of its own (``sampler_devices``): open-instruct's generation apart from training.

The last k devices form the sampler's mesh (``jodpo.program.run.meshes``); the training mesh holds the rest. Each rollout the
sampler receives the policy's weights (``train_step.sampler_weights``: in the compute dtype, or only the LoRA
adapters), samples the rollout's prompts with the draw the state would use (``fold_in(rng, step)``), and hands the
completions to the training mesh.

With ``async_mode`` rollout t samples with the parameters from before update t - 1, so rollout t + 1's sampling
(with the parameters before update t) is launched before update t and both run at once, on different devices: JAX
dispatches asynchronously, and nothing waits for the other until rollout t + 1's completions are needed. The state
is the same as on one mesh (``sampler_params`` included, which is what makes a resume exact), so the run equals the
single-mesh ``async_mode`` run. Without ``async_mode`` each rollout needs the parameters of the update just before
it: the sampler then only takes turns with the trainer (memory apart, nothing gained).

With ``sync_steps`` = s the sampler's weights change only at multiples of s optimizer steps, and only then are they
sent: the other rollouts sample with the weights the sampler already holds (the state's ``sampler_params``).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jodpo import collective_order
from jodpo.parallel import sharding as S
from jodpo import train_step as ts
from jodpo.models import lora
from jodpo.models.decoder import Params
from jodpo.sampling import Samples


class SplitSampler:
    """The sampler of a run with ``sampler_devices``: ``samples(state, step)`` returns rollout ``step``'s completions
    on the training mesh, and with ``async_mode`` has already started the next rollout's."""

    def __init__(self, step_cfg: ts.StepConfig, train_mesh: Mesh, mesh: Mesh, rng: jax.Array,
                 prompts: Callable[[int, Mesh], tuple[jax.Array, jax.Array]], updates_per_step: int, total_steps: int,
                 base: Params | None = None, lora_targets: tuple[str, ...] = ()):
        """``mesh``: the sampler's devices; ``prompts(step, mesh)``: rollout ``step``'s prompt ids and mask, put on
        ``mesh``; ``base``: with LoRA (``lora_targets``), the frozen weights the adapters ride on."""
        self.step_cfg, self.train_mesh, self.mesh, self.prompts = step_cfg, train_mesh, mesh, prompts
        self.updates_per_step, self.total_steps = updates_per_step, total_steps
        model = step_cfg.model
        specs = lora.adapter_specs(model, lora_targets) if lora_targets else None
        self.weight_shardings = S.param_shardings(model, self.mesh, specs)
        # with LoRA the frozen base the adapters ride on, sent once
        self.base = jax.device_put(base, S.param_shardings(model, self.mesh)) if lora_targets else None
        self.rng = jax.device_put(rng, S.replicated(self.mesh))
        self._weights = collective_order.jit(functools.partial(ts.sampler_weights, step_cfg))
        self._sample = collective_order.jit(ts.sample_with, static_argnums=(0, 6))
        self.pending: tuple[int, Samples] | None = None  # (rollout, its completions, on the sampler's devices)
        self.weights = None  # the weights on the sampler's devices, and the state's step they are from
        self.weights_step: int | None = None

    def launch(self, params, step: int, version: int) -> None:
        """Start sampling rollout ``step`` on the sampler's devices with the policy of optimizer step ``version``:
        ``params`` (the trained parameters, sent) or, when the sampler already holds that version, nothing sent.
        Returns at once."""
        if self.weights_step != version:
            self.weights = jax.device_put(self._weights(params), self.weight_shardings)
            self.weights_step = version
        ids, mask = self.prompts(step, self.mesh)
        draw = np.int32(step * self.updates_per_step)  # the state's step at rollout ``step``
        samples = self._sample(self.step_cfg, self.weights, self.rng, draw, ids, mask, None, self.base)
        self.pending = (step, samples)

    def samples(self, state: ts.TrainState, step: int) -> Samples:
        """Rollout ``step``'s completions, on the training mesh; with ``async_mode`` the next rollout's sampling (with
        ``state.params``, the parameters before this step's update, or with ``sync_steps`` the weights it holds) is
        started before this returns. Steps are counted on the host (``step`` x updates per rollout): nothing waits for
        the device to say which."""
        cfg, U = self.step_cfg, self.updates_per_step
        s, now = cfg.sync_steps, step * U  # the state's step
        if self.pending is None or self.pending[0] != step:  # the first rollout (or any, without async_mode)
            if not cfg.lagging:
                self.launch(state.params, step, now)
            else:  # the state's sampler: the policy of the last multiple of s (async_mode: before the last rollout)
                last = max(now - U, 0) if cfg.async_mode else now
                self.launch(state.params if not cfg.async_mode and now % s == 0 else state.sampler_params, step,
                            last - last % s)
        samples = jax.device_put(self.pending[1], jax.tree.map(  # [A, kB, ...]: split by rows (decode_steps: [A, kB])
            lambda x: S.batch_sharding(self.train_mesh, min(x.ndim, 3)), self.pending[1]))
        self.pending = None
        if cfg.async_mode and step + 1 < self.total_steps:
            self.launch(state.params, step + 1, now - now % s)  # sent only when ``now`` is a multiple of s
        return samples

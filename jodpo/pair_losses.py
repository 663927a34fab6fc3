"""The pairwise losses of the DPO family: each its own pure function of a ``Pair`` of log-ratios, chosen from
``LOSSES`` by name (formulas as in TRL's ``trl/trainer/dpo_trainer.py``; ``simpo`` as TRL's CPOTrainer), and their
options. ``jodpo.losses`` applies them to batches (and re-exports these names)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Pair:
    """Summed log-ratios log pi - log pi_ref of the chosen and rejected completions, and their lengths (for a
    reference-free loss: the policy's average per-token log-probs)."""

    chosen: jax.Array  # f32[B]
    rejected: jax.Array  # f32[B]
    chosen_len: jax.Array  # f32[B], completion tokens (EOS included)
    rejected_len: jax.Array


@dataclasses.dataclass(frozen=True)
class LossOptions:
    label_smoothing: float = 0.0  # cDPO (sigmoid), robust, exo_pair: the assumed label-flip rate
    discopop_tau: float = 0.05
    ipo_length_normalized: bool = False  # TRL's online trainer sums; its offline DPO normalises
    simpo_gamma: float = 0.5  # SimPO's target reward margin gamma (TRL CPOConfig's simpo_gamma)
    rdpo_alpha: float = 0.0  # R-DPO's length coefficient alpha (Park et al. 2024); not TRL's rpo_alpha (an NLL term)
    ld_alpha: float | None = None  # LD-DPO (TRL DPOConfig): weight of the log-probs past the shorter completion


def _delta(p: Pair):
    return p.chosen - p.rejected


def _smoothed(z, e):
    """-log sigmoid(z); with a label-flip rate e, cDPO's -(1 - e) log sigmoid(z) - e log sigmoid(-z)."""
    return -(1 - e) * jax.nn.log_sigmoid(z) - e * jax.nn.log_sigmoid(-z)


def sigmoid_loss(p: Pair, beta, o: LossOptions):
    """DPO; with label smoothing, cDPO."""
    return _smoothed(beta * _delta(p), o.label_smoothing)


def simpo_loss(p: Pair, beta, o: LossOptions):
    """SimPO (Meng et al. 2024), as TRL's CPOTrainer computes it (``loss_type="simpo"``): the Pair holds average
    per-token log-probs (no reference), ``-log sigmoid(beta * (c - r) - gamma)``; with label smoothing as CPO's."""
    return _smoothed(beta * (_delta(p) - o.simpo_gamma / beta), o.label_smoothing)


def rdpo_loss(p: Pair, beta, o: LossOptions):
    """R-DPO (Park et al. 2024, "Disentangling Length from Quality in DPO", eq. 9): DPO with the length term
    ``alpha * (|y_c| - |y_r|)`` added to the margin inside the log-sigmoid, so a pair whose chosen completion is the
    longer one pushes less on the policy (the length share of the preference is explained away)."""
    return _smoothed(beta * _delta(p) + o.rdpo_alpha * (p.chosen_len - p.rejected_len), o.label_smoothing)


def ipo_loss(p: Pair, beta, o: LossOptions):
    if o.ipo_length_normalized:
        d = p.chosen / jnp.maximum(p.chosen_len, 1.0) - p.rejected / jnp.maximum(p.rejected_len, 1.0)
    else:
        d = _delta(p)
    return (d - 1 / (2 * beta)) ** 2


def hinge_loss(p: Pair, beta, o: LossOptions):
    return jax.nn.relu(1 - beta * _delta(p))


def robust_loss(p: Pair, beta, o: LossOptions):
    z, e = beta * _delta(p), o.label_smoothing
    return (-(1 - e) * jax.nn.log_sigmoid(z) + e * jax.nn.log_sigmoid(-z)) / (1 - 2 * e)


def exo_pair_loss(p: Pair, beta, o: LossOptions):
    z, e = beta * _delta(p), o.label_smoothing
    return (jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-e))
            + jax.nn.sigmoid(-z) * (jax.nn.log_sigmoid(-z) - jnp.log(e)))


def nca_pair_loss(p: Pair, beta, o: LossOptions):
    c, r = beta * p.chosen, beta * p.rejected
    return -jax.nn.log_sigmoid(c) - 0.5 * jax.nn.log_sigmoid(-c) - 0.5 * jax.nn.log_sigmoid(-r)


def sppo_hard_loss(p: Pair, beta, o: LossOptions):
    return (p.chosen - 0.5 / beta) ** 2 + (p.rejected + 0.5 / beta) ** 2


def apo_zero_loss(p: Pair, beta, o: LossOptions):
    return 1 - jax.nn.sigmoid(beta * p.chosen) + jax.nn.sigmoid(beta * p.rejected)


def apo_down_loss(p: Pair, beta, o: LossOptions):
    return jax.nn.sigmoid(beta * p.chosen) + 1 - jax.nn.sigmoid(beta * _delta(p))


def discopop_loss(p: Pair, beta, o: LossOptions):
    z = beta * _delta(p)
    w = jax.nn.sigmoid(z / o.discopop_tau)
    return -jax.nn.log_sigmoid(z) * (1 - w) + jnp.exp(-z) * w


LOSSES: dict[str, Callable[[Pair, jax.Array, LossOptions], jax.Array]] = {
    "sigmoid": sigmoid_loss, "ipo": ipo_loss, "hinge": hinge_loss, "robust": robust_loss,
    "exo_pair": exo_pair_loss, "nca_pair": nca_pair_loss, "sppo_hard": sppo_hard_loss,
    "apo_zero": apo_zero_loss, "apo_down": apo_down_loss, "discopop": discopop_loss,
    "simpo": simpo_loss, "rdpo": rdpo_loss,
}
# Losses without a reference model: their Pair holds the policy's average log-probs (TRL CPOTrainer's
# average_log_prob for simpo), their implicit rewards are beta times those averages, and no reference is read or run.
REFERENCE_FREE = frozenset({"simpo"})


def needs_reference(loss_type: str) -> bool:
    """Whether ``loss_type`` compares the policy with a frozen reference (every loss but ``REFERENCE_FREE``'s)."""
    return loss_type not in REFERENCE_FREE


def get_loss(loss_type: str):
    """The per-sequence loss function of ``loss_type``; unknown names get the list of known ones."""
    try:
        return LOSSES[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {sorted(LOSSES)}") from None


def check_loss_options(loss_type: str, o: LossOptions) -> None:
    get_loss(loss_type)
    if loss_type == "robust" and not 0 <= o.label_smoothing < 0.5:
        raise ValueError("loss_type='robust' needs 0 <= label_smoothing < 0.5")
    if loss_type == "exo_pair" and not 0 < o.label_smoothing < 1:
        raise ValueError("loss_type='exo_pair' needs 0 < label_smoothing < 1 (TRL suggests 1e-3)")
    if o.rdpo_alpha and loss_type != "rdpo":
        raise ValueError(f"rdpo_alpha is R-DPO's length term and loss_type is {loss_type!r}: set loss_type='rdpo' "
                         "or rdpo_alpha=0")
    if o.ld_alpha is not None and not 0 <= o.ld_alpha <= 1:
        raise ValueError(f"ld_alpha must be in [0, 1] (1: plain log-probs, 0: the verbose part masked), got "
                         f"{o.ld_alpha}")
    if o.ld_alpha is not None and not needs_reference(loss_type):
        raise ValueError(f"ld_alpha weights DPO's log-ratios (TRL's DPOTrainer); loss_type={loss_type!r} has no "
                         "reference and already averages over the length: unset ld_alpha")

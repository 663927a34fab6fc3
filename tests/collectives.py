"""A collective XLA:CPU lacks, written from ``all_gather`` to its documented definition, so that the code that calls
it on TPUs and GPUs runs in the suite too."""
import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``: sender s's slice ``j`` (``operand[input_offsets[j]:][:send_sizes[j]]``) goes to
    device ``j // (len(input_offsets) / n)`` and is written there at the sender's ``output_offsets[j]``; the receiver's
    ``recv_sizes`` name the lengths it expects, in the senders' order. The result is NaN where a receiver's
    ``recv_sizes`` disagree with what its senders send (the constraint the real collective leaves undefined)."""
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    per = input_offsets.shape[0] // n  # slices a device
    senders = jax.lax.all_gather(operand, axis_name)
    starts, sizes, landings = (jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(a, axis_name), me * per, per, axis=1)
                               for a in (input_offsets, send_sizes, output_offsets))  # the slices sent here
    rows = jnp.arange(output.shape[0])
    result = output
    for s in range(n):
        for j in range(per):
            inside = (rows >= landings[s, j]) & (rows < landings[s, j] + recv_sizes[s * per + j])
            source = jnp.clip(starts[s, j] + rows - landings[s, j], 0, operand.shape[0] - 1)
            result = jnp.where(inside.reshape((-1,) + (1,) * (output.ndim - 1)), senders[s][source], result)
    return jnp.where(jnp.all(sizes == recv_sizes.reshape(n, per)), result, jnp.nan)

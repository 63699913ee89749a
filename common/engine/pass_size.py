"""How many host cores a pass is worth, and how to weigh a prompt's attention against its
matmuls: the figures the core pool (cores.py) and the prefill lanes (lanes.py) size by."""

from __future__ import annotations

# Typical rates of one host core (fp32 matmul; memory streamed), to size a pass: it is
# worth a thread for every MIN_MS_PER_THREAD it would take on one core.
HOST_FLOPS_PER_CORE = 50e9
HOST_BYTES_PER_CORE = 10e9
MIN_MS_PER_THREAD = 20.0


def layer_params(spec) -> int:
    """Weights of one decoder layer's matmuls (2 FLOPs each a token)."""
    return (
        spec.hidden_size * (spec.q_size + 2 * spec.kv_size)
        + spec.q_size * spec.hidden_size
        + 3 * spec.hidden_size * spec.intermediate_size
    )


def pair_cost(spec) -> float:
    """A prompt's attention per (query, key) pair (QK^T and PV: 4 FLOPs a query dimension)
    over a token's matmuls, in a layer: how to cut a prompt into parts of equal work."""
    return 4 * spec.q_size / (2 * layer_params(spec))


def threads_worth(spec, dtype, num_tokens: int, num_rows: int) -> int:
    """Cores a pass over num_tokens (num_rows of them sampled) is worth: its time on one
    core, the matmuls' FLOPs or the weights it streams, over MIN_MS_PER_THREAD. A tiny
    model's pass is worth one: an op split over threads then waits at its end for all."""
    layer = layer_params(spec)
    head = spec.vocab_size * spec.hidden_size
    flops = 2 * (spec.num_layers * layer * max(num_tokens, num_rows) + head * num_rows)
    stream = (spec.num_layers * layer + head) * dtype.itemsize
    one_core_ms = max(flops / HOST_FLOPS_PER_CORE, stream / HOST_BYTES_PER_CORE) * 1e3
    return max(1, int(one_core_ms // MIN_MS_PER_THREAD))

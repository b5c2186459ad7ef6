"""What a split transformer keeps and sends, as formulas: Korthikanti et al.'s activations, the messages per step.

Activations a block keeps for backward (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023, section 4), for a sequence of s
tokens, a micro-batch of b, width h, a heads, 16-bit activations and 1-byte dropout masks:

    one process                 sbh (34 + 5as/h)
    tensor parallel over t      sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel  sbh (34/t + 5as/(ht))

The terms, in elements of e bytes per sbh: the two LayerNorms' inputs (2), the inputs of the
q/k/v and first MLP layers (2), q, k and v (3), the output projection's input (1), the GELU's
input and the second MLP layer's input (8); plus the two residual dropout masks (2 bytes) and,
per attention head, the softmax output and the dropped probabilities (2e as/h) with their mask
(as/h bytes). Tensor parallelism splits all but the first four and the two masks (10 bytes
at e = 2); sequence parallelism splits those too. `activation_bytes_per_layer` gives them for
any element size, `element_bytes=2` being the paper's.

Bytes each rank sends per training step, with the ring halves of `collectives` (each half of
n elements sends (t-1)/t n of them): per block, tensor parallelism allreduces s·b·h values
twice forward and twice backward; sequence parallelism sends the same bytes as two allgathers
and two reduce-scatters each way, plus one allgather per column-parallel layer in backward
(the input it did not keep). Outside the blocks: the embedding's sum and the output layer's
input (one allreduce each, or two halves each), the loss's maxima (an allgather of b·s
values) and its sums (an allreduce of 2·b·s values), and with sequence parallelism one
allreduce of the replicated parameters' gradients.
"""

from __future__ import annotations


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, element_bytes: int = 2
) -> float:
    """Bytes one transformer block keeps for backward on each of t ranks (Korthikanti et al.'s terms)."""
    e = element_bytes
    replicated = 4 * e + 2  # LayerNorm inputs, q/k/v and MLP inputs; the two residual dropout masks (1 byte)
    split = 12 * e  # q, k, v; projection input; GELU input; second MLP layer's input (4h each)
    attention = (2 * e + 1) * a * s / h  # softmax output, dropped probabilities, their mask
    if sequence_parallel:
        return s * b * h * (replicated + split + attention) / t
    return s * b * h * (replicated + split / t + attention / t)


def ring_bytes(n: int, t: int, element_bytes: int) -> float:
    """Bytes a rank sends in one ring half (reduce-scatter or allgather) of n elements over t ranks."""
    return (t - 1) / t * n * element_bytes


def bytes_sent_per_step(
    s: int,
    b: int,
    h: int,
    layers: int,
    t: int,
    sequence_parallel: bool = False,
    element_bytes: int = 4,
    replicated_parameters: int = 0,
) -> dict[str, float]:
    """Bytes each rank sends in one training step of TensorParallelGPT, by part ("blocks", "embedding and
    output layer", "loss", "sequence-parallel gradients"), and "total"."""
    sbh = ring_bytes(s * b * h, t, element_bytes)
    halves_per_block = 2 * 4 + (2 if sequence_parallel else 0)  # 4 allreduces = 8 halves; SP regathers twice
    tokens = s * b
    parts = {
        "blocks": layers * halves_per_block * sbh,
        "embedding and output layer": 4 * sbh,
        "loss": (t - 1) * tokens * element_bytes + 2 * ring_bytes(2 * tokens, t, element_bytes),
        "sequence-parallel gradients": (
            2 * ring_bytes(replicated_parameters, t, element_bytes) if sequence_parallel else 0.0
        ),
    }
    return {**parts, "total": sum(parts.values())}

"""The caching allocator's reserve beyond the allocated peak, on small models of torchtitan's training step.

torchtitan's benchmark tables publish torch's reserved peak (`max_memory_reserved`); lab 16's oracle counts the
allocated one. Each configuration below runs three steps as torchtitan's train step does (float32 weights, bfloat16
autocast, every block checkpointed, an untied output layer, torch's cross entropy on a float32 copy of the logits,
AdamW), traced on this CPU and replayed through the CUDA caching allocator's rules (`ddlab.oracle.allocator`). It
prints the allocated and reserved peaks, and the gap in units of the 16-bit logits, the block torchtitan's loss
leaves cached (tests/test_oracle_allocator.py): whether the gap is that block and no more. And step by step, the
reserve beside the loss's most allocated moment: whether that block, cached in the first step, is still free beside
the loss in the next ones, or the optimizer's state (made after the first loss) took it. One process; about 4
minutes.

    .venv/bin/python bench/reserved_memory.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ddlab.models.gpt import GPTConfig, make_gpt
from ddlab.oracle.allocator import CachingAllocator, replay, trace
from torch.utils.checkpoint import checkpoint

#: (sequences, tokens each, width, vocabulary, layers)
SHAPES = ((4, 256, 128, 16384, 4), (4, 256, 256, 8192, 8), (8, 256, 128, 8192, 2), (2, 256, 512, 32768, 4))


#: The size of a marker tensor each step allocates just before its loss and frees after its backward, so that the
#: replay knows where the loss and the backward run (no other tensor of these models has that many bytes).
MARK = 777 * 512 + 3


def reserve(sequences: int, tokens: int, hidden: int, vocab: int, layers: int) -> tuple[float, list[float], str]:
    """Over three replayed steps: the reserved peak beyond the allocated one, and per step the reserve beyond what is
    allocated at the most allocated moment of its loss and backward, both in 16-bit logits' blocks; and both peaks,
    said in words."""
    config = GPTConfig(vocab_size=vocab, block_size=tokens, n_layer=layers, n_head=2, n_embd=hidden, tied=False)
    model = make_gpt(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(vocab, (sequences, tokens), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16):
            x = model.wte(ids) + model.wpe(torch.arange(tokens))
            for block in model.blocks:
                x = checkpoint(block, x, None, use_reentrant=False)
            pred = F.linear(model.ln_f(x), model.output_weight)
        mark = torch.empty(MARK, dtype=torch.uint8)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), ids.flatten())
        del pred  # as torchtitan's train step does
        loss.backward()
        del mark
        optimizer.step()
        optimizer.zero_grad()

    block = 2 * sequences * tokens * vocab
    marker, busiest = None, (0, 0)  # the marker's address while a loss runs; (allocated, reserved) at its busiest
    beside: list[float] = []

    def steps() -> None:
        for _ in range(3):
            step()

    def watch(allocator: CachingAllocator, address: int, size: int) -> None:
        nonlocal marker, busiest
        if size == MARK:
            marker, busiest = address, (0, 0)
        elif size <= 0 and address == marker:
            beside.append((busiest[1] - busiest[0]) / block)
            marker = None
        if marker is not None and allocator.allocated > busiest[0]:
            busiest = (allocator.allocated, allocator.reserved)

    allocator = replay(trace(steps), watch)
    assert len(beside) == 3, f"the marker of {MARK} bytes was seen {len(beside)} times, not once a step"
    peaks = (
        f"allocated {allocator.peak_allocated / 2**20:6.1f} MiB, reserved {allocator.peak_reserved / 2**20:6.1f} MiB"
    )
    return (allocator.peak_reserved - allocator.peak_allocated) / block, beside, peaks


def main() -> None:
    gaps = []
    for sequences, tokens, hidden, vocab, layers in SHAPES:
        gap, beside, peaks = reserve(sequences, tokens, hidden, vocab, layers)
        gaps.append(gap)
        print(
            f"{sequences} x {tokens} tokens, width {hidden:3d}, vocabulary {vocab:5d}, {layers} layers: {peaks}, the "
            f"gap {gap:.2f}x the 16-bit logits; beside the loss's peak, step by step: "
            f"{', '.join(f'{b:.2f}' for b in beside)}x"
        )
    print(
        f"the reserve beyond the allocated peak is {min(gaps):.2f}-{max(gaps):.2f}x the 16-bit logits' block: not a "
        "fixed share the oracle could add"
    )


if __name__ == "__main__":
    main()

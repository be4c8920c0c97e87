"""A LoRA adapter away from its starting point, for tests that compare two paths through it.

peft starts every B matrix at zero: the adapter then adds nothing to any forward, and A gets no gradient (its
gradient is B's transpose times something). Two paths through such an adapter (merged and unmerged weights, the
shared prompt and the plain forward, one process and two) agree on A's gradient and on every output whatever they
do with the adapter, so a test of them checks nothing about it. Moved off zero, both matter.
"""

import torch


def move_b_off_zero(model, seed: int = 0, std: float = 0.02) -> int:
    """Sets every LoRA B weight of `model` to N(0, std^2), drawn in the order of the parameters' sorted names from a
    generator of its own (the same values in every process and whatever ran before); returns how many it set.
    std 0.02, the tiny models' initializer range: the adapter changes log-probs by more than float32 rounding without
    swamping the base weights."""
    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for _, weight in sorted((n, p) for n, p in model.named_parameters() if ".lora_B." in n):
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float32) * std)
            moved += 1
    assert moved, "no LoRA B weight in the model"
    return moved


def lora_gradients(named_grads: dict) -> dict:
    """{"A": total |gradient| over the LoRA A weights, "B": the same over B's} of {parameter name: gradient}."""
    return {
        part: sum(float(grad.abs().sum()) for name, grad in named_grads.items() if f".lora_{part}." in name)
        for part in ("A", "B")
    }

"""What the engine adapters share: probabilities in as logits, seeds from torch generators,
in-place output checks."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _params

# Seeds drawn from a torch.Generator cover the whole int64 range (our seeds are 64-bit keys).
_SEED_LOW, _SEED_HIGH = -2**63, 2**63 - 1


def logits_from_probs(probs: torch.Tensor, name: str) -> torch.Tensor:
    """``log(probs)`` in float32: a valid logits row whose softmax is ``probs / sum(probs)``.

    A zero becomes ``-inf`` (never sampled, never accepted); a negative or NaN entry becomes
    NaN, which the kernels treat as ``-inf``. Cost: one elementwise pass over ``probs`` that
    writes a float32 copy of the same shape (4 bytes per entry) -- the price of taking
    probabilities where our kernels read logits.
    """
    _params.check_tensor(probs, name, dtypes=_params.LOGIT_DTYPES + (torch.float64,))
    return torch.log(probs.to(torch.float32))


def seeds_from_generator(generator: torch.Generator, batch: int,
                         device: torch.device) -> torch.Tensor:
    """``[batch]`` int64 seeds drawn from ``generator`` (one draw per call, on the generator's
    device, then moved without a synchronisation): a run is repeatable from the generator's
    seed, and the generator advances as the engine's sampler expects."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    seeds = torch.randint(_SEED_LOW, _SEED_HIGH, (batch,), dtype=torch.int64,
                          generator=generator, device=generator.device)
    return seeds.to(device, non_blocking=True)


def check_counter(counter: Optional[torch.Tensor], name: str, batch: int,
                  device: torch.device) -> None:
    """An in-place output counter: a ``[batch]`` int32/int64 tensor on the logits' device."""
    if counter is None:
        return
    _params.check_tensor(counter, name, dtypes=_params.INDEX_DTYPES, device=device)
    _params.check_shape(counter, name, [batch], "one per request")

"""What the engine adapters share: probabilities in as logits, seeds from torch generators,
in-place output checks."""
from __future__ import annotations

import contextlib
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
    return torch.log(probs if probs.dtype == torch.float32 else probs.to(torch.float32))


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


# --- added for the FlashInfer and SGLang adapters (issue 24) ---------------------------------

# Row stride of a batch-wide seed: request b of a batch keyed by one seed s gets the Philox
# seed s + b * ROW_SEED_STRIDE (mod 2**64). The stride is 2**64 / golden ratio (odd): for
# |b - b'| < 2**20 the seeds of rows b and b' differ by at least 2**43 (checked by
# exhaustion in python_tests/test_adapter_flashinfer.py), so two calls whose seeds differ by
# less than 2**43 (a step counter, FlashInfer's "update the seed every call") never share a
# stream, and rows of one call never do. ``seed + b`` had (s+1, b) == (s, b+1).
ROW_SEED_STRIDE = 0x9E3779B97F4A7C15 - 2**64  # as int64
ROW_SEED_MIN_GAP_LOG2 = 43
ROW_SEED_MAX_ROWS_LOG2 = 20


def row_seeds(seed, batch: int, device: torch.device) -> torch.Tensor:
    """``[batch]`` int64 seeds for a batch keyed by one seed (a Python int or a ``[1]`` int64
    tensor): ``seed + b * ROW_SEED_STRIDE`` wrapped to int64, without a synchronisation."""
    if isinstance(seed, torch.Tensor):
        if seed.dim() != 1 or seed.shape[0] != 1:
            seed = seed.reshape(-1)[:1]
        seed = _params.as_int64(seed)
        if batch == 1:  # row 0's seed is the seed itself
            return seed
        return _params.arange(batch, device) * ROW_SEED_STRIDE + seed
    return torch.arange(batch, dtype=torch.int64, device=device) * ROW_SEED_STRIDE + seed


def value_checks_wanted(validate: Optional[bool], device: torch.device) -> bool:
    """``validate=None`` (the adapters' default): run the checks that read tensor values only
    where they cost no device synchronisation and break no graph -- eager calls on CPU
    tensors. On CUDA (and under ``torch.compile``) they are skipped, as the engines' own
    kernels skip them; ``True``/``False`` force either way."""
    if validate is not None:
        if not isinstance(validate, bool):
            raise TypeError(f"validate: expected a bool or None, got {type(validate).__name__}")
        return validate
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu"


def restoring_generator(generator: Optional[torch.Generator]):
    """A context manager that puts ``generator`` back as it was when the body raises (a
    rejected call advances no generator); nothing to do for None."""
    return contextlib.nullcontext() if generator is None else _restoring(generator)


@contextlib.contextmanager
def _restoring(generator: torch.Generator):
    state = generator.get_state()
    try:
        yield
    except BaseException:
        generator.set_state(state)
        raise


def capturing_cuda_graph(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``device``."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())

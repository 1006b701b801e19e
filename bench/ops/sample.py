"""``sample()``: one token per row of ``[B, V]`` logits (temperature 1, or greedy)."""
from __future__ import annotations

import torch

from .. import baselines
from ..harness import Case, Impl, Skip, torch_dtype
from . import triton_backend_available

OP = "sample"
SPEEDUP_BASELINE = "torch_unfused"  # the speedup column divides this backend's time by ours

BYTES_FORMULA = ("B*V*s (each logit read once in its dtype) + B*4 (int32 token ids)"
                 " + B*20 (seed, offset int64 and temperature fp32 per request)")


def min_bytes(case: Case) -> int:
    b, v = case.params["B"], case.params["V"]
    s = torch.empty((), dtype=torch_dtype(case.dtype)).element_size()
    return b * v * s + b * 4 + b * 20


def _case(b, v, dtype, mode="sampled"):
    return Case(OP, {"B": b, "V": v}, dtype, mode)


def cases(device: torch.device, preset: str) -> list[Case]:
    if preset == "quick":
        return [_case(4, 1000, "fp32")]
    if preset == "cpu":
        return [_case(b, v, "bf16") for b in (1, 8, 64) for v in (32000, 128256)]
    if preset == "gpu_check":
        return [_case(b, 128256, "bf16") for b in (1, 64, 256)] + [_case(64, 151936, "fp32")]
    return [_case(b, v, dt) for dt in ("bf16", "fp32") for v in (32000, 128256, 151936)
            for b in (1, 8, 64, 256)]


def make_inputs(case: Case, device: torch.device) -> dict:
    b, v = case.params["B"], case.params["V"]
    gen = torch.Generator(device=device).manual_seed(99)
    return {"logits": (3 * torch.randn(b, v, generator=gen, device=device)).to(torch_dtype(case.dtype)),
            "seed": torch.arange(b, dtype=torch.int64, device=device),
            "offset": torch.zeros(b, dtype=torch.int64, device=device)}


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    temperature = 0.0 if case.mode == "greedy" else 1.0

    def ours(backend):
        return lambda x: sk.sample(x["logits"], temperature=temperature, seed=x["seed"],
                                   offset=x["offset"], backend=backend, validate=False)
    ok, why = triton_backend_available(device, "sampling")
    return [
        Impl("triton", ours("triton"), graphable=True) if ok else Skip("triton", why, kind="ours"),
        Impl("reference", ours("reference")),
        Impl("torch_unfused", lambda x: baselines.unfused_sample(x["logits"], temperature),
             kind="baseline", graphable=True, note="fp32 softmax, exponential race"),
        Impl("torch_multinomial", lambda x: baselines.multinomial_sample(x["logits"], temperature),
             kind="baseline", note="fp32 softmax, torch.multinomial"),
    ]

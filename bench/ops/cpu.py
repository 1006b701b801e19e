"""The C++ CPU path (``backend="auto"`` on CPU tensors) against the reference, side by side:
``verify_chain`` with draft logits, with and without top-p 0.9 (temperature 1), and ``sample``
rows (mode ``sample``, with top-p 0.9). Inputs and minimal bytes are the chain op's
(``bench/ops/chain.py``, mode ``draft_logits``: every target and draft logit read once).
CPU only (on a GPU the rows are skipped: CUDA tensors take the Triton kernels).
"""
from __future__ import annotations

import dataclasses

import torch

from ..harness import Case, Impl, Skip, torch_dtype
from . import chain

OP = "cpu"
SPEEDUP_BASELINE = "reference"

BYTES_FORMULA = ("chain modes: " + chain.BYTES_FORMULA + " (mode draft_logits); sample: "
                 "B*V*s + B*24")

MODES = ("draft_logits", "draft_logits_top_p")


def _as_chain(case: Case) -> Case:
    return dataclasses.replace(case, op=chain.OP, mode="draft_logits")


def min_bytes(case: Case) -> int:
    if case.mode == "sample":
        b, v = case.params["B"], case.params["V"]
        return b * v * torch.empty((), dtype=torch_dtype(case.dtype)).element_size() + b * 24
    return chain.min_bytes(_as_chain(case))


def _case(b, v, dtype, mode, skip=()):
    return Case(OP, {"B": b, "K": 4, "V": v}, dtype, mode, tuple(skip))


def cases(device: torch.device, preset: str) -> list[Case]:
    if device.type != "cpu":
        return []
    if preset == "quick":
        return [_case(4, 1000, "fp32", m) for m in MODES]
    # The issue-16 sweep; the reference at B = 64 only at V = 49152 (it takes seconds per call).
    out = [_case(16, 49152, dt, m) for dt in ("bf16", "fp32") for m in MODES]  # the target row
    out += [_case(b, v, dt, m, ("reference",) if b == 64 and v != 49152 else ())
            for b in (1, 16, 64) for v in (32000, 49152, 128256) for dt in ("fp32", "bf16")
            for m in MODES if not (b == 16 and v == 49152)]
    out += [_case(b, 128256, "bf16", "sample") for b in (1, 16)]
    return out


def make_inputs(case: Case, device: torch.device) -> dict:
    return chain.make_inputs(_as_chain(case), device)


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    from specdec_kernels import _cpu  # noqa: PLC0415
    filters = dict(top_p=0.9) if case.mode in ("draft_logits_top_p", "sample") else {}

    def ours(backend):
        if case.mode == "sample":
            return lambda x: sk.sample(x["target_logits"][:, 0], temperature=1.0, seed=x["seed"],
                                       offset=x["offset"], backend=backend, validate=False,
                                       **filters)
        return lambda x: sk.verify_chain(
            x["target_logits"], x["draft_token_ids"], draft_logits=x["draft_logits"],
            temperature=1.0, seed=x["seed"], offset=x["offset"], backend=backend,
            validate=False, **filters)
    cpp = Impl("cpp", ours("auto")) if _cpu.AVAILABLE else \
        Skip("cpp", "specdec_kernels._C not built with the CPU sampling ops", kind="ours")
    return [cpp, Impl("reference", ours("reference"))]

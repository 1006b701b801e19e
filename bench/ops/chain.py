"""Chain verification: ``verify_chain`` against the unfused and vLLM-style pipelines and FlashInfer.

Modes: ``onehot`` (no draft distribution: an n-gram or greedy drafter), ``draft_probs``
(fp32 ``[B, K, V]`` draft probabilities), ``draft_logits`` (draft logits in the target dtype)
``greedy`` (temperature 0, one-hot drafts) and ``top_k_top_p`` (draft probs with top-k 50 and
top-p 0.9 on every request: the filters' threshold search; ours and the reference only, the
baselines have no filters). Sampled modes use temperature 1.

Drop-in modes (contract sections 8-10), each ``draft_probs`` plus one feature, against the plain
``draft_probs`` chain: ``min_p`` (0.05 on every request), ``bitmask`` (an xgrammar-style int32
``[B, K+1, ceil(V/32)]`` mask allowing about half the vocabulary), ``logprobs`` / ``logprobs_raw``
(``return_logprobs="processed"`` / ``"raw"``), and ``packed``: ``verify_chain_packed`` on the
flattened ``[B*(K+1), V]`` logits, against ``pad+triton`` / ``pad+reference``, the gather into
``[B, K+1, V]`` that an engine pays today before calling ``verify_chain``.
"""
from __future__ import annotations

import torch

from .. import baselines
from ..harness import Case, Impl, Skip, torch_dtype
from . import triton_backend_available

OP = "chain"
SPEEDUP_BASELINE = "torch_unfused"  # the speedup column divides this backend's time by ours

BYTES_FORMULA = (
    "B*(K+1)*V*s  (each target logit read once in its dtype, s = 2 for bf16, 4 for fp32)"
    " + B*K*4  (draft ids, int32)"
    " + draft_probs: B*K*4 (the gathered q(d)) + B*V*4 (one fp32 draft row per request for the residual)"
    " | draft_logits: B*K*V*s (every draft row, its softmax statistics are needed)"
    " | onehot/greedy: 0"
    " + B*(K+1)*4 + B*4  (output ids and num_accepted, int32)"
    " + B*20  (seed, offset int64 and temperature fp32 per request)"
    " ; drop-in modes (draft_probs plus): min_p + B*4 (fp32 min_p)"
    " | bitmask + B*(K+1)*ceil(V/32)*4 (the int32 words)"
    " | logprobs, logprobs_raw + B*(K+1)*4 (fp32 logprobs)"
    " | packed + (B+1)*4 (cu_num_draft_tokens)")

DROPIN_MODES = ("min_p", "bitmask", "logprobs", "logprobs_raw", "packed")
DRAFT_PROBS_MODES = ("draft_probs", "top_k_top_p") + DROPIN_MODES

SAMPLED_TEMPERATURE = 1.0

# Modes that also get a "compiled" variant (torch.compile(fullgraph=True) of the call, at
# B = 1: the launch-bound case; RunConfig.compiled_max_batch), beside eager and graph.
COMPILED_MODES = ("draft_probs", "onehot")


def min_bytes(case: Case) -> int:
    b, k, v = case.params["B"], case.params["K"], case.params["V"]
    s = torch.empty((), dtype=torch_dtype(case.dtype)).element_size()
    total = b * (k + 1) * v * s + b * k * 4 + b * (k + 1) * 4 + b * 4 + b * 20
    if case.mode in DRAFT_PROBS_MODES:
        total += b * k * 4 + b * v * 4
    elif case.mode == "draft_logits":
        total += b * k * v * s
    total += {"min_p": b * 4, "bitmask": b * (k + 1) * -(-v // 32) * 4,
              "logprobs": b * (k + 1) * 4, "logprobs_raw": b * (k + 1) * 4,
              "packed": (b + 1) * 4}.get(case.mode, 0)
    return total


def _case(b, k, v, dtype, mode, skip=()):
    return Case(OP, {"B": b, "K": k, "V": v}, dtype, mode, tuple(skip))


def cases(device: torch.device, preset: str) -> list[Case]:
    if preset == "quick":
        return [_case(b, 2, 1000, "fp32", m) for b in (1, 4) for m in ("onehot", "draft_probs")] + \
               [_case(4, 2, 1000, "bf16", "greedy"), _case(4, 2, 1000, "bf16", "top_k_top_p")] + \
               [_case(4, 2, 1000, "bf16", m) for m in DROPIN_MODES]
    if preset == "cpu":
        # A subset of the issue-2 sweep that the reference path gets through in a few minutes.
        out = [_case(b, 4, 32000, "bf16", m) for b in (1, 8, 64) for m in ("onehot", "draft_probs")]
        out += [_case(8, 4, v, dt, "draft_probs") for v in (128256, 151936) for dt in ("bf16", "fp32")]
        out += [_case(8, 4, 32000, "fp32", "draft_probs"), _case(8, 4, 128256, "bf16", "greedy"),
                _case(8, 1, 128256, "bf16", "draft_probs"), _case(8, 8, 128256, "bf16", "draft_probs")]
        return out
    if preset == "gpu_check":
        # The fixed shapes of bench/gpu_check.sh: latency against batch at the issue-2 shape,
        # roofline against vocabulary, K, fp32 and the modes at the target B=64, K=4, V=128256.
        slow = ("reference",)
        out = [_case(b, 4, 128256, "bf16", m, slow if b != 64 else ())
               for b in (1, 8, 64, 256) for m in ("draft_probs", "onehot")]
        # (before the sweeps: the harness may stop at its time budget)
        out += [_case(b, 4, 128256, "bf16", "top_k_top_p", slow) for b in (1, 64)]
        out += [_case(64, 4, v, dt, "draft_probs", slow) for v in (32000, 151936) for dt in ("bf16",)]
        out += [_case(64, 4, v, "fp32", "draft_probs", slow) for v in (32000, 128256, 151936)]
        out += [_case(64, k, 128256, "bf16", "draft_probs", slow) for k in (1, 8)]
        out += [_case(64, 4, 128256, "bf16", m, slow) for m in ("greedy", "draft_logits")]
        # Issue 13: the drop-in modes against the plain draft_probs chain at B in {1, 16, 64, 256}.
        out += [_case(b, 4, 128256, "bf16", m, slow)
                for m in DROPIN_MODES for b in (1, 16, 64, 256)]
        out += [_case(16, 4, 128256, "bf16", "draft_probs", slow)]
        return out
    # "gpu": the full issue-2 sweep.
    return [_case(b, k, v, dt, m, () if b <= 64 else ("reference",))
            for dt in ("bf16", "fp32") for v in (32000, 128256, 151936) for k in (1, 4, 8)
            for b in (1, 8, 64, 256) for m in ("draft_probs", "onehot")]


def make_inputs(case: Case, device: torch.device) -> dict:
    b, k, v = case.params["B"], case.params["K"], case.params["V"]
    gen = torch.Generator(device=device).manual_seed(1234)
    # Logit scale 3 gives a peaked but not one-hot distribution, like an LLM's.
    target = (3 * torch.randn(b, k + 1, v, generator=gen, device=device)).to(torch_dtype(case.dtype))
    inputs = {"target_logits": target,
              "seed": torch.arange(b, dtype=torch.int64, device=device) + 17,
              "offset": torch.zeros(b, dtype=torch.int64, device=device)}
    # A draft that agrees with the target often: target logits plus noise.
    draft_logits = target[:, :k].float() + torch.randn(b, k, v, generator=gen, device=device)
    if case.mode in DRAFT_PROBS_MODES:
        inputs["draft_probs"] = torch.softmax(draft_logits, dim=-1)
    elif case.mode == "draft_logits":
        inputs["draft_logits"] = draft_logits.to(torch_dtype(case.dtype))
    inputs["draft_token_ids"] = draft_logits.argmax(-1).to(torch.int32)
    del draft_logits
    if case.mode == "bitmask":
        inputs["token_bitmask"] = torch.randint(-2**31, 2**31 - 1, (b, k + 1, -(-v // 32)),
                                                generator=gen, device=device, dtype=torch.int32)
    if case.mode == "packed":  # every request with K drafts: the flattened rows, in vLLM's order
        inputs["target_logits"] = target.reshape(b * (k + 1), v)
        inputs["draft_token_ids"] = inputs["draft_token_ids"].reshape(b * k)
        inputs["draft_probs"] = inputs["draft_probs"].reshape(b * k, v)
        inputs["cu_num_draft_tokens"] = torch.arange(0, b * k + 1, k, dtype=torch.int32,
                                                     device=device)
    return inputs


def _temperature(case: Case) -> float:
    return 0.0 if case.mode == "greedy" else SAMPLED_TEMPERATURE


def _filters(case: Case) -> dict:
    return {"top_k_top_p": dict(top_k=50, top_p=0.9), "min_p": dict(min_p=0.05),
            "logprobs": dict(return_logprobs="processed"),
            "logprobs_raw": dict(return_logprobs="raw")}.get(case.mode, {})


def _ours(backend: str, case: Case):
    import specdec_kernels as sk  # noqa: PLC0415 -- keep `python -m bench --help` light
    temperature = _temperature(case)
    filters = _filters(case)

    if case.mode == "packed":
        def run(x):
            return sk.verify_chain_packed(
                x["target_logits"], x["draft_token_ids"], x["cu_num_draft_tokens"],
                max_draft_tokens=case.params["K"], draft_probs=x["draft_probs"],
                temperature=temperature, seed=x["seed"], offset=x["offset"], backend=backend,
                validate=False)
        return run

    def run(x):
        return sk.verify_chain(x["target_logits"], x["draft_token_ids"],
                               draft_probs=x.get("draft_probs"), draft_logits=x.get("draft_logits"),
                               temperature=temperature, seed=x["seed"], offset=x["offset"],
                               token_bitmask=x.get("token_bitmask"), backend=backend,
                               validate=False, **filters)
    return run


def _pad_then_verify(backend: str, case: Case):
    """What an engine pays today: gather the packed rows into ``[B, K+1, V]`` (a copy of the
    logits, from offsets computed on the device), then ``verify_chain``."""
    import specdec_kernels as sk  # noqa: PLC0415
    from specdec_kernels.reference.packed import packed_layout  # noqa: PLC0415
    k = case.params["K"]

    def run(x):
        layout = packed_layout(x["cu_num_draft_tokens"], x["draft_token_ids"].shape[0], k)
        draft_rows = layout.draft_rows.clamp(max=max(layout.num_packed - 1, 0))
        return sk.verify_chain(x["target_logits"][layout.target_rows],
                               x["draft_token_ids"][draft_rows],
                               draft_probs=x["draft_probs"][draft_rows],
                               num_draft_tokens=layout.num_draft_tokens,
                               temperature=_temperature(case), seed=x["seed"],
                               offset=x["offset"], backend=backend, validate=False)
    return run


def _triton_parts(case: Case, temperature: float) -> list:
    """Where the fused pipeline's time goes, and what an engine that keeps its fp32 copy pays:

    * stage ``1_row_stats`` of ``triton``: the statistics as the pipeline launches them (the
      one full read of the target logits, plus the finish kernel when split rows are
      filtered; acceptance and the race read one row per request);
    * backend ``fp32copy+triton``: the engine's fp32 copy with temperature (torch), then our
      fused kernels on that copy -- the cost of the copy with everything else ours.
    """
    import specdec_kernels as sk  # noqa: PLC0415
    from specdec_kernels import _params  # noqa: PLC0415
    from specdec_kernels.triton import stats as tstats  # noqa: PLC0415

    def prepare_stats(x):
        logits = x["target_logits"]
        filters = _filters(case)
        params = _params.sampling_params(temperature, filters.get("top_k"), filters.get("top_p"),
                                         batch=logits.shape[0],
                                         vocab_size=logits.shape[-1], device=logits.device,
                                         validate=False)
        return logits, params

    def stats(y):
        logits, params = y
        return tstats.row_stats(logits, params, merge_in_consumer=True)

    parts = [Impl("triton", stats, kind="stage", stage="1_row_stats", prepare=prepare_stats)]
    if temperature > 0 and not _filters(case):
        def copy_then_ours(x):
            scaled = baselines.vllm_fp32_temperature(x["target_logits"], temperature)
            draft_logits = x.get("draft_logits")
            return sk.verify_chain(scaled, x["draft_token_ids"], draft_probs=x.get("draft_probs"),
                                   draft_logits=None if draft_logits is None else draft_logits,
                                   temperature=1.0, seed=x["seed"], offset=x["offset"],
                                   backend="triton", validate=False)
        parts.append(Impl("fp32copy+triton", copy_then_ours, kind="baseline", graphable=True,
                          note="torch fp32 copy with temperature, then the fused kernels"))
    return parts


def implementations(case: Case, device: torch.device) -> list:
    temperature = _temperature(case)
    impls: list = []
    ok, why = triton_backend_available(device, "chain")
    compilable = case.mode in COMPILED_MODES
    impls.append(Impl("triton", _ours("triton", case), graphable=True, compilable=compilable)
                 if ok else Skip("triton", why, kind="ours"))
    if ok and case.mode not in DROPIN_MODES:
        impls += _triton_parts(case, temperature)
    impls.append(Impl("reference", _ours("reference", case), compilable=compilable,
                      note="Philox noise over [B, V] in int64 torch ops"))
    if case.mode == "packed":
        if ok:
            impls.append(Impl("pad+triton", _pad_then_verify("triton", case), kind="baseline",
                              graphable=True, note="gather to [B, K+1, V], then verify_chain"))
        return impls + [Impl("pad+reference", _pad_then_verify("reference", case),
                             kind="baseline", note="gather to [B, K+1, V], then the reference")]
    if case.mode in DROPIN_MODES:
        return impls + [Skip(name, "feature not in this baseline (compare with mode draft_probs)")
                        for name in ("torch_unfused", "vllm_style", "flashinfer")]
    if case.mode == "top_k_top_p":
        return impls + [Skip(name, "no top-k/top-p in this baseline")
                        for name in ("torch_unfused", "vllm_style", "flashinfer")]

    if case.mode == "draft_logits":
        # The baselines take probabilities: their softmax of the draft is part of their cost.
        def draft_q(x):
            return torch.softmax(x["draft_logits"].float() / temperature, dim=-1)
    else:
        def draft_q(x):
            return x.get("draft_probs")

    impls.append(Impl("torch_unfused", lambda x: baselines.unfused_chain(
        x["target_logits"], x["draft_token_ids"], draft_q(x), temperature),
        kind="baseline", graphable=True, note="fp32 softmax, then torch ops"))

    if temperature > 0:
        impls.append(Impl("vllm_style", lambda x: baselines.vllm_style_chain(
            x["target_logits"], x["draft_token_ids"], draft_q(x), temperature),
            kind="baseline", graphable=True))
        impls.append(Impl("vllm_style", lambda x: baselines.vllm_fp32_temperature(
            x["target_logits"], temperature), kind="stage", stage="1_fp32_copy_temperature"))
        impls.append(Impl("vllm_style", lambda y: baselines.vllm_statistics(y), kind="stage",
                          stage="2_statistics", prepare=lambda x: baselines.vllm_fp32_temperature(
                              x["target_logits"], temperature)))

        def prepare_resample(x):
            scaled = baselines.vllm_fp32_temperature(x["target_logits"], temperature)
            return scaled, baselines.vllm_statistics(scaled), x["draft_token_ids"], draft_q(x)
        impls.append(Impl("vllm_style", lambda y: baselines.vllm_accept_resample(*y),
                          kind="stage", stage="3_accept_resample", prepare=prepare_resample))

    if case.mode != "draft_probs":
        impls.append(Skip("flashinfer", "chain_speculative_sampling needs draft_probs "
                                        "(timed in mode draft_probs only)"))
    elif device.type != "cuda":
        impls.append(Skip("flashinfer", "FlashInfer is CUDA-only"))
    else:
        ok, why = baselines.flashinfer_available()
        if not ok:
            impls.append(Skip("flashinfer", why))
        else:
            impls.append(Impl("flashinfer", lambda x: baselines.flashinfer_chain(
                x["target_logits"], x["draft_token_ids"], x["draft_probs"], temperature),
                kind="baseline", note="fp32 softmax, then chain_speculative_sampling"))
            impls.append(Impl("flashinfer", lambda y: baselines.flashinfer_chain_from_probs(*y),
                              kind="stage", stage="kernel_only",
                              prepare=lambda x: (x["draft_probs"], x["draft_token_ids"],
                                                 torch.softmax(x["target_logits"].float(), -1))))
    return impls

"""pytest plugin (``-p engine_tests.vllm.swap_0_34``) for vLLM 0.34.0's own MRV2 tests.

1. docs/engines.md's swap line, before vLLM's test modules import anything:
   ``mrv2_0_34.swap()`` (vLLM's ``RejectionSampler`` and ``rejection_sample`` become ours).
2. Without CUDA: engine_tests/device_shim.py maps the tests' ``device="cuda"`` to the CPU, and
   while the test modules are imported (collection only) ``torch.cuda.is_available()`` and
   vLLM's ``current_platform.is_cuda*()`` answer True, which lifts their module-level skip and
   their ``skipif(not current_platform.is_cuda())`` marks. Restored before any test runs.
   A UVA view of a host tensor (vLLM's ``get_accelerator_view_from_cpu_tensor``) is the
   tensor itself, and ``torch.cpu.get_rng_state`` is the CPU generator's. Under
   ``TRITON_INTERPRET=1`` vLLM's ``tldevice.log1p`` (libdevice, which the interpreter lacks) is
   ``tl.log(1 + x)`` (a series near 0), for vLLM's own kernels that the delegated modes run.
3. A per-test time limit (``ENGINE_TEST_TIMEOUT`` seconds, default 300; SIGALRM, so a test
   stuck in one long C call is stopped when it returns) and, in run.py, a memory cap
   (``ulimit -v``): a test sized for a GPU fails with the limit named instead of taking the
   machine down.
vLLM's files stay as the sdist ships them.
"""
import gc
import os
import signal
import sys

import pytest
import torch

from engine_tests import device_shim
from specdec_kernels.adapters.vllm import mrv2_0_34

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton's interpreter has no libdevice (an extern call returns None): vLLM's own kernels
    # (the delegated modes, its Gumbel sampler) get log1p in triton.language's terms.
    import types

    import triton.language as tl
    import vllm.triton_utils

    def _log1p(x):
        small = tl.abs(x) < 1e-4
        return tl.where(small, x - x * x / 2 + x * x * x / 3, tl.log(1.0 + x))
    vllm.triton_utils.tldevice = types.SimpleNamespace(log1p=_log1p)
    for _name in ("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils",
                  "vllm.v1.worker.gpu.sample.gumbel", "vllm.v1.worker.gpu.sample.watermark"):
        _module = __import__(_name, fromlist=["_"])
        if hasattr(_module, "tldevice"):
            _module.tldevice = vllm.triton_utils.tldevice

mrv2_0_34.swap()  # docs/engines.md

CPU_SHIM = device_shim.install()
_restore = []
if CPU_SHIM:
    from vllm.platforms import current_platform

    _restore.append((torch.cuda, "is_available", torch.cuda.is_available))
    torch.cuda.is_available = lambda: True
    for name in ("is_cuda", "is_cuda_alike"):
        _restore.append((current_platform, name, getattr(current_platform, name)))
        setattr(current_platform, name, lambda: True)
    # The CPU's own answers where a test asks for the accelerator's: a UVA view of a host
    # tensor is that tensor, and the "device" RNG state is the CPU generator's.
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    buffer_utils.get_accelerator_view_from_cpu_tensor = lambda cpu_tensor: cpu_tensor
    if not hasattr(torch.cpu, "get_rng_state"):
        torch.cpu.get_rng_state = torch.get_rng_state


# vLLM's tests that compare our tokens (the stock path, swapped in) with vLLM's own kernels'
# tokens (a vLLM-only mode the adapter delegates: FLy, watermarking) for the same seed. The
# two draw from different random streams (docs/engines.md: randomness), so such a test passes
# only where the tokens are forced; not a difference of law. Marked, not strict: a forced case
# may pass. {test name: (a parameter id it needs or None, reason)}
_STREAMS = ("compares our tokens with vLLM's own {mode} kernel's for the same seed: different "
            "random streams by design (docs/engines.md, vLLM 0.34.0: randomness)")
CROSS_STREAM = {
    "test_fly_pending_window_preserves_recovery_position": ("-0.7]", _STREAMS.format(mode="FLy")),
    "test_chunked_requests_match_full_batch": ("[2-", _STREAMS.format(mode="FLy")),
    "test_repeated_draft_context_does_not_change_acceptance": (
        None, _STREAMS.format(mode="watermarking")),
    "test_repeated_context_skip_mask_is_read_per_row_in_a_block": (
        None, _STREAMS.format(mode="watermarking")),
    "test_repeated_recovery_context_uses_ordinary_residual_sample": (
        None, _STREAMS.format(mode="watermarking")),
    "test_repeated_bonus_context_uses_ordinary_target_sample": (
        None, _STREAMS.format(mode="watermarking")),
    "test_repeated_context_does_not_change_unwatermarked_or_greedy_rows": (
        None, _STREAMS.format(mode="watermarking")),
    "test_watermarked_recovery_leaves_disabled_rows_on_the_stock_draw": (
        None, _STREAMS.format(mode="watermarking")),
}


# Without a GPU: tests whose time goes to vLLM's own Triton kernels in the interpreter, at the
# sizes they were written for (measured on 2 loaded CPU cores: each ran past the 240 s
# per-test limit, or is the same kernel at the same size). {test name: (param id, reason)}
_INTERPRETED = ("without a GPU: {what} in Triton's interpreter ran past the 240 s per-test "
                "limit here; runs on a GPU")
CPU_SKIPS = {
    "test_gumbel_drafted_rejection_sample_is_unbiased": (None, _INTERPRETED.format(
        what="vLLM's gumbel_sample drafting 200,000 x K proposals")),
    "test_multiround_rejection_sample_is_unbiased": ("[True-False]", _INTERPRETED.format(
        what="vLLM's gumbel_sample drafting up to 32,768 rows per round")),
    "test_multiround_rejection_sample_is_unbiased[True-True]": (None, _INTERPRETED.format(
        what="vLLM's gumbel_sample drafting up to 32,768 rows per round (as [True-False])")),
    "test_synthetic_rejection_sample": (None, "without a GPU: not run here (not measured): "
                                        "vLLM's own kernels (synthetic rates are delegated) "
                                        "over 163,840 logits rows x 4,096 tokens in Triton's "
                                        "interpreter, one program per row; runs on a GPU"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        base = item.name.split("[")[0]
        for key in (item.name, base):
            if CPU_SHIM and key in CPU_SKIPS and (
                    CPU_SKIPS[key][0] is None or item.name.endswith(CPU_SKIPS[key][0])):
                item.add_marker(pytest.mark.skip(reason=CPU_SKIPS[key][1]))
                break
        if base in CROSS_STREAM:
            needs, reason = CROSS_STREAM[base]
            if needs is None or (needs in item.name if needs.startswith("[")
                                 else item.name.endswith(needs)):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


def pytest_collection_finish(session):
    while _restore:
        owner, name, original = _restore.pop()
        setattr(owner, name, original)


class TestTimeLimit(Exception):
    """A test ran past ENGINE_TEST_TIMEOUT (this machine's limit, not a failure of ours)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get("ENGINE_TEST_TIMEOUT", "300"))

    def stop(signum, frame):
        raise TestTimeLimit(f"ran past the per-test limit of {limit} s on this machine")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _over_a_limit(excinfo):
    """The reason when a test stopped at this machine's memory cap or time limit, else None."""
    error, seen = excinfo.value, set()
    while error is not None and id(error) not in seen:  # the interpreter wraps ours
        seen.add(id(error))
        text = str(error)
        if isinstance(error, TestTimeLimit) or "TestTimeLimit" in text:
            return f"not run here: {text.split('ran past', 1)[-1].join(['ran past', ''])}" \
                if "ran past" in text else "not run here: past the per-test time limit"
        if isinstance(error, MemoryError) or "can't allocate memory" in text:
            cap = os.environ.get("ENGINE_TESTS_MEMORY_GB", "?")
            return (f"not run here: past the {cap} GB address-space cap (RLIMIT_AS) of this "
                    f"machine's run: {text.strip().splitlines()[-1][:120]}")
        error = error.__cause__ or error.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by the machine's limits is reported skipped with the limit named (it
    could not run here), not as a failure of ours or a pass."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        reason = _over_a_limit(call.excinfo)
        if reason:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, reason)


def pytest_runtest_teardown(item, nextitem):
    # pytest keeps the last failure's traceback (sys.last_traceback, for post-mortems): its
    # frames hold that test's inputs, gigabytes here, which the next test would pay for under
    # the memory cap. Drop them between tests.
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()


def pytest_runtest_logreport(report):
    """Each test's outcome as it ends (``ENGINE_TESTS_LOG``): a file stopped by its time limit
    still says what ran."""
    path = os.environ.get("ENGINE_TESTS_LOG")
    if path and (report.when == "call" or report.outcome != "passed"):
        message = "" if report.passed else str(report.longrepr).strip().splitlines()[-1][:200]
        with open(path, "a") as out:
            out.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t"
                      f"{report.duration:.1f}\t{message}\n")


def pytest_report_header(config):
    return [f"vLLM 0.34.0 MRV2: RejectionSampler / rejection_sample -> "
            f"specdec_kernels.adapters.vllm.mrv2_0_34; device shim "
            f"{'on (no CUDA): cuda -> cpu, module-level CUDA skips lifted' if CPU_SHIM else 'off'}"]

"""`python -m specdec_kernels.demo --synthetic`: verify a batch of synthetic drafts with the
fastest backend here, check it against the reference, and print acceptance and timing.

On a CUDA machine the fused Triton kernels run on the GPU; on a CPU-only machine the
reference path is the fastest backend, and the Triton kernels are checked token for token
under Triton's interpreter on a smaller batch.
"""
from __future__ import annotations

import os
import time
import warnings

import torch

if not torch.cuda.is_available():  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import specdec_kernels as sk  # noqa: E402

BATCH, NUM_DRAFTS, VOCAB = 64, 4, 32000
AGREEMENT = {"high": 0.3, "medium": 1.0, "low": 3.0}  # draft = target + noise of this scale


def _problem(device, noise_scale, batch=BATCH, vocab=VOCAB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, NUM_DRAFTS + 1, vocab, generator=gen) * 3
    draft = target[:, :NUM_DRAFTS] + noise_scale * torch.randn(batch, NUM_DRAFTS, vocab,
                                                               generator=gen)
    target, draft = target.to(device, torch.bfloat16), draft.to(device, torch.bfloat16)
    seeds = torch.arange(batch, device=device)
    sampled = torch.stack([sk.sample(draft[:, j], seed=seeds, offset=j, backend="reference")
                           for j in range(NUM_DRAFTS)], 1)
    return target, draft, sampled, seeds


def _time(fn, repeats=3):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "triton" if device.type == "cuda" else "reference"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"specdec_kernels demo: verify_chain, B={BATCH} K={NUM_DRAFTS} V={VOCAB} bf16 logits, "
          f"backend={backend} on {name}\n")
    header = f"{'agreement':>9} | {'mode':>7} | {'accepted/step':>13} | {'tokens/step':>11} | " \
             f"{'time ms':>8} | {'= reference':>11}"
    print(header)
    print("-" * len(header))
    for agreement, scale in AGREEMENT.items():
        target, draft, sampled, seeds = _problem(device, scale)
        for mode in ("sampled", "greedy"):
            if mode == "sampled":  # drafts drawn from q = processed_probs(draft_logits)
                drafts, kw = sampled, dict(draft_logits=draft, temperature=1.0)
            else:  # a greedy drafter: its arg-max, checked against the target's
                drafts, kw = draft.float().argmax(-1), dict(temperature=0.0)
            kw.update(seed=seeds, offset=100)
            run = lambda: sk.verify_chain(target, drafts, backend=backend, **kw)  # noqa: E731
            out = run()
            ms = _time(run)
            ref = sk.verify_chain(target, drafts, backend="reference", **kw)
            same = (out.output_token_ids == ref.output_token_ids).all(-1).float().mean().item()
            accepted = out.num_accepted.float().mean().item()
            print(f"{agreement:>9} | {mode:>7} | {accepted:>13.2f} | {accepted + 1:>11.2f} | "
                  f"{ms:>8.2f} | {same:>10.1%}")
    if device.type == "cpu":
        _interpreter_check()


def _interpreter_check() -> None:
    """The Triton kernels, interpreted on the CPU, against the reference on a small batch."""
    target, draft, drafts, seeds = _problem(torch.device("cpu"), 1.0, batch=4, vocab=2048)
    kw = dict(draft_logits=draft, seed=seeds, offset=100)
    start = time.perf_counter()
    try:  # the public op imports the kernels on its first Triton call
        with warnings.catch_warnings():  # numpy's notes on masked lanes (-inf - -inf), by design
            warnings.simplefilter("ignore", RuntimeWarning)
            out = sk.verify_chain(target, drafts, backend="triton", **kw)
    except ImportError as err:
        print(f"\nTriton kernels not available here ({err}); skipped the interpreter check.")
        return
    seconds = time.perf_counter() - start
    ref = sk.verify_chain(target, drafts, backend="reference", **kw)
    same = (out.output_token_ids == ref.output_token_ids).all(-1).float().mean().item()
    print(f"\nTriton kernels under the interpreter (B=4, K={NUM_DRAFTS}, V=2048): "
          f"{same:.0%} of requests equal the reference token for token ({seconds:.1f} s; "
          f"the interpreter is for correctness, not speed).")


if __name__ == "__main__":
    main()

"""`make demo`: speculative generation on a real model (the embedded SmolLM2-135M-Instruct).

A few real prompts, each generated alone (batch 1), by plain greedy decoding and with
speculation (n-gram prompt lookup with adaptive length; the model's own first 8 layers as a
draft), verified by ``specdec_kernels``' ops: the text, tokens/s with and without
speculation, the acceptance, and whether the tokens equal plain greedy decoding's.

    python -m specdec_kernels.demo [--target FOLDER] [--tokens 48]
    python -m specdec_kernels.demo --synthetic     # the verify ops alone, on synthetic logits
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdec_kernels.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", action="store_true", help="the synthetic verify table")
    ap.add_argument("--target", default=None, help="a local model folder (default: embedded)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt at most")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.synthetic:
        from . import demo_synthetic
        demo_synthetic.main()
        return

    import torch
    torch.set_num_threads(args.threads)
    from .e2e import engine as E
    from .e2e.model import early_exit_draft, load_model
    from .e2e.tasks import task_requests

    start = time.perf_counter()
    model, tokenizer = load_model(args.target)
    draft = early_exit_draft(model, 8)
    print(f"loaded {model.name_or_path} in {time.perf_counter() - start:.0f} s "
          f"({torch.get_num_threads()} threads)\n")
    requests = (task_requests(tokenizer, "copy", 2, max_new_tokens=args.tokens)
                + task_requests(tokenizer, "rare_terms", 1, max_new_tokens=args.tokens))
    eos = tokenizer.eos_token_id
    E.warm_up(model, requests, draft_model=draft, eos_token_id=eos, max_new_tokens=3)

    def one_by_one(spec):
        """Each request alone (batch 1): a batch's wall time is its slowest request's, and
        the rare_terms answer gains nothing from drafts."""
        tokens, stats = [], E.Stats()
        for request in requests:
            result = E.generate(model, [request], E.Sampling(), spec, draft_model=draft,
                                eos_token_id=eos)
            tokens += result.tokens
            stats.merge(result.stats)
        return E.Result(tokens, stats)

    plain = one_by_one(E.Speculation())
    runs = [("plain greedy decoding", plain)]
    for label, spec in (("n-gram lookup, adaptive K", E.Speculation("ngram", "adaptive")),
                        ("draft = first 8 layers, K=2", E.Speculation("model", 2))):
        runs.append((label, one_by_one(spec)))
    for i, request in enumerate(requests):
        prompt = tokenizer.decode(request.prompt)
        user = prompt.split("<|im_start|>user")[-1].split("<|im_end|>")[0].strip()
        print(f"--- prompt {i + 1}: {textwrap.shorten(user, 100)}")
        print(textwrap.indent(tokenizer.decode(runs[1][1].tokens[i],
                                               skip_special_tokens=True).strip(), "    "))
    base = plain.stats.tokens / plain.stats.wall_s
    print(f"\n{'':28} | {'tokens':>6} | {'tokens/s':>8} | {'x plain':>7} | "
          f"{'accepted/step':>13} | {'= plain greedy':>14}")
    for label, result in runs:
        rate = result.stats.tokens / result.stats.wall_s
        same = "yes" if result.tokens == plain.tokens else "NO"
        print(f"{label:28} | {result.stats.tokens:>6} | {rate:>8.1f} | {rate / base:>7.2f} | "
              f"{result.stats.mean_accepted:>13.2f} | {same:>14}")
    if any(r.tokens != plain.tokens for _, r in runs):
        sys.exit("speculation changed the greedy tokens")


if __name__ == "__main__":
    main()

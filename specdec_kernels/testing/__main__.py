"""``python -m specdec_kernels.testing {chain,tree,sampler} --verifier module:function``.

Prints the report's table; exits 1 when a test fails, 2 on bad arguments."""
from __future__ import annotations

import argparse
import functools
import importlib
import sys

from . import adapters, check_chain_verifier, check_sampler, check_tree_verifier

LAYOUTS = {"ours": lambda fn: fn, "vllm": adapters.from_vllm,
           "flashinfer": adapters.from_flashinfer, "sglang": adapters.from_sglang}


def load(spec: str):
    """``package.module:function[,key=value...]`` -> the callable (keyword values are Python
    literals or strings, bound with functools.partial)."""
    target, _, bound = spec.partition(",")
    module, _, name = target.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(f"expected package.module:function, got {spec!r}")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    kwargs = {}
    for item in filter(None, bound.split(",")):
        key, _, value = item.partition("=")
        try:
            import ast
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return functools.partial(fn, **kwargs) if kwargs else fn


def _list(text: str) -> tuple:
    return tuple(x for x in text.split(",") if x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels.testing",
                                     description="Certify a speculative-decoding verifier.")
    parser.add_argument("kind", choices=["chain", "tree", "sampler"])
    parser.add_argument("--verifier", required=True, type=load,
                        help="package.module:function[,key=value...] (e.g. "
                             "specdec_kernels:verify_chain,backend=reference)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ours",
                        help="the callable's layout (wrapped by testing.adapters)")
    parser.add_argument("--modes", type=_list, help="draft modes, comma separated")
    parser.add_argument("--params", type=_list, default=("temperature", "top_k", "top_p"),
                        help="sampling parameters the callable takes (empty: none)")
    parser.add_argument("--methods", type=_list, default=("token",))
    parser.add_argument("--unseeded", action="store_true",
                        help="the callable takes no seed/offset (torch's generator is seeded)")
    parser.add_argument("--draft-sampler", type=load, default=None,
                        help="chain: draw drafts with this sampler and the verifier's seeds")
    parser.add_argument("--samples", type=int, default=None, help="trials per configuration")
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--tv", type=float, default=0.05)
    parser.add_argument("--power", type=float, default=0.95)
    parser.add_argument("--tail", action="store_true", help="also run the tail probes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    verify = LAYOUTS[args.layout](args.verifier)
    common = dict(params=args.params, seeded=not args.unseeded, alpha=args.alpha, tv=args.tv,
                  power=args.power, samples=args.samples, seed=args.seed, device=args.device)
    if args.modes:
        common["draft_modes"] = args.modes
    if args.kind == "chain":
        report = check_chain_verifier(verify, methods=args.methods, tail=args.tail,
                                      draft_sampler=args.draft_sampler, **common)
    elif args.kind == "tree":
        report = check_tree_verifier(verify, methods=args.methods, **common)
    else:
        common.pop("draft_modes", None)
        report = check_sampler(verify, tail=args.tail, **common)
    print(report.table())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

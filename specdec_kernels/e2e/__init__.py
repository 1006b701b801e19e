"""Speculative generation on a real model with specdec_kernels' public ops: the decode loop
(:func:`generate`), drafters (n-gram prompt lookup, a draft model or the target's own first
layers), request sets and transformers' own decoding as peers; a continuous-batching serving
loop (:func:`serve`, :class:`Server`) and its load generator. See docs/e2e.md."""
from .config import Request, Result, Sampling, Speculation, Stats
from .engine import generate
from .load import Arrival, ClosedLoop, poisson_arrivals
from .serving import Server, serve
from .verify import verify_methods
from .model import early_exit_draft, embedded_model, load_model

__all__ = ["Request", "Result", "Sampling", "Speculation", "Stats", "generate", "serve",
           "Server", "Arrival", "ClosedLoop", "poisson_arrivals",
           "verify_methods", "early_exit_draft", "embedded_model", "load_model"]

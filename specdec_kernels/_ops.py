"""Every backend entry of every public op as a registered ``torch.library`` op (contract
section 15), in one place.

The public functions (``sampling``, ``chain``, ``tree``, ``tree_attention``, ``kv_cache``)
parse and validate their arguments in Python, then make exactly one call to one of the ops
below (or, on CPU, to the C++ ops of ``_C``). Each op has a fake (meta) implementation that
gives every output's shape and dtype from the input shapes alone, so ``torch.compile``
traces a call without a graph break and ``torch.library.opcheck`` passes; ops that write in
place declare it (``mutates_args``).

Ops defined here (Python implementations; schemas inferred from their annotations, as
``torch.library.custom_op`` infers them):

========================================  =====================================================
``specdec::reference_processed_probs``    ``processed_probs`` (always the reference)
``specdec::reference_sample``             ``sample``, ``backend="reference"``
``specdec::reference_verify_chain``       ``verify_chain``, reference
``specdec::reference_verify_chain_packed`` ``verify_chain_packed``, reference
``specdec::reference_verify_tree``        ``verify_tree``, reference
``specdec::reference_build_tree_attention`` ``build_tree_attention``, reference
``specdec::reference_compact_kv_cache``   ``compact_kv_cache``, reference (mutates ``caches``)
``specdec::reference_compact_paged_kv_cache`` ``compact_paged_kv_cache``, reference (mutates)
``specdec::triton_sample``                ``sample``, Triton
``specdec::triton_verify_chain``          ``verify_chain``, Triton
``specdec::triton_verify_chain_packed``   ``verify_chain_packed``, Triton (rows read in place)
``specdec::triton_verify_tree``           ``verify_tree``, Triton
``specdec::draw_seeds``                   ``seed=None``: one seed per request from torch's
                                          default generator, at run time
``specdec::check_values``                 a validated call's value checks, under
                                          ``torch.compile`` (eagerly a plain call)
========================================  =====================================================

Ops of the compiled extension (schemas in ``csrc/torch``), given their fakes here:
``specdec::cpu_sample``, ``cpu_verify_chain``, ``cpu_verify_chain_packed``, ``cpu_verify_tree``,
``cpu_processed_probs`` (the C++ CPU path, ``_cpu``), ``specdec::build_tree_attention``,
``compact_kv_cache``, ``compact_paged_kv_cache`` (CPU and CUDA kernels; the last two mutate
``caches``).

The Triton entries are opaque ops, not ``torch.library.triton_op``: a ``triton_op`` body is traced by
Inductor, and ours keeps host-side state across calls (one-element scratch tensors kept for
the life of the process so a captured graph may hold them, per-device SM counts) and launches
kernels from five modules, each of which would have to go through ``wrap_triton``. As opaque
custom ops, Inductor calls them as they run eagerly (the same launches, the same tokens);
see docs/graphs.md.

Conventions that keep every signature inferable: a ``SamplingParams`` travels as its eight
fields (``PARAMS`` order), ``return_logprobs`` as ``str?``, and the Python ops return a list
(``Tensor[]``): the outputs, then ``logprobs`` only when asked for (no allocation otherwise;
the C++ ops return an empty ``[0]`` tensor there). To add a keyword argument to an op: one more parameter of its
implementation below (fakes read their arguments by name, see ``_fake``), and the public
function passes it.
"""
import inspect
from typing import Callable, Optional

import torch

from . import _extension, _types  # _extension first: it loads _C, which defines specdec::*

NAMESPACE = "specdec"

# op name (without the namespace) -> its Python implementation: what
# ``testing.forbid_host_sync(descend=True)`` runs under its guard instead of the op.
IMPLEMENTATIONS: dict[str, Callable] = {}

_EMPTY_LOGPROBS_SHAPE = (0,)


# One library fragment holds every Python op (the C++ ops' TORCH_LIBRARY(specdec) is the
# namespace's definition; _C is loaded first).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _define(name: str, mutates_args=(), tags=()):
    """Defines ``specdec::<name>`` with the schema inferred from the decorated
    implementation's annotations (as ``torch.library.custom_op`` infers it) and registers the
    implementation for every device (``CompositeExplicitAutograd``). A plain ``Library``
    registration, not ``custom_op``: the latter's dispatch wrappers (autograd, device-type
    routing) cost more per eager call than the op itself at B = 1 (docs/graphs.md); none of
    these ops has a gradient. Returns the implementation (call the op through
    ``torch.ops.specdec``)."""
    def register(fn):
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIBRARY.define(name + schema, tags=tuple(tags))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        IMPLEMENTATIONS[name] = fn
        return fn
    return register


def _fake(name: str, signature_of: Optional[Callable] = None):
    """Registers ``shapes(**arguments)`` as the fake of ``specdec::<name>``: it gets every
    argument by name (defaults applied), so a parameter added to the implementation needs no
    change here. ``signature_of``: where the argument names come from (default: the Python
    implementation; a C++ op's names are spelt by a stub)."""
    signature = inspect.signature(signature_of or IMPLEMENTATIONS[name])

    def register(shapes):
        def fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return shapes(**bound.arguments)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        return shapes
    return register


def call(name: str, *args):
    """``torch.ops.specdec.<name>(*args)``: how the public functions run an op of this module.

    In plain eager mode (nothing compiling, no dispatch or function mode, no functorch
    transform) it calls the op's implementation directly: the same code the op would run,
    without the dispatcher's boxing of 10-20 arguments, which costs more than a B = 1 launch
    (docs/graphs.md). Whoever can look at ops (``torch.compile``, ``FakeTensorMode``,
    ``make_fx``, ``forbid_host_sync``, any ``TorchDispatchMode``) gets the registered op."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return getattr(torch.ops.specdec, name).default(*args)
    return IMPLEMENTATIONS[name](*args)


def params_args(params: _types.SamplingParams) -> tuple:
    """A ``SamplingParams`` as the eight op arguments of ``PARAMS``."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.uses_top_k,
            params.uses_top_p, params.all_greedy, params.uses_min_p)


PARAMS = _types.PARAMS


def _sampling_params(temperature, top_k, top_p, min_p, uses_top_k, uses_top_p, all_greedy,
                     uses_min_p) -> _types.SamplingParams:
    return _types.SamplingParams(temperature, top_k, top_p, uses_top_k, uses_top_p,
                                  all_greedy, min_p, uses_min_p)


def _logprobs_out(logprobs: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The op's trailing outputs: ``[logprobs]`` when asked for, else none (no allocation)."""
    return [] if logprobs is None else [logprobs]


def logprobs_or_none(trailing: list) -> Optional[torch.Tensor]:
    """The public value of an op's trailing ``logprobs`` outputs: None when not asked for."""
    return trailing[0] if trailing else None


def _logprobs_fake(like: torch.Tensor, shape, return_logprobs) -> list[torch.Tensor]:
    return [] if return_logprobs is None else [like.new_empty(shape, dtype=torch.float32)]


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


@_define("draw_seeds", tags=(torch.Tag.nondeterministic_seeded,))
def draw_seeds(like: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 seeds drawn from torch's default generator, on ``like``'s device
    (``like`` is any ``[B]`` tensor: the offsets). An op, so that under ``torch.compile`` the
    draw happens when the compiled step runs, every call, from the same generator as in
    eager mode (a traced ``torch.randint`` would become Inductor's own random numbers).
    Under CUDA-graph capture a graph would replay one draw forever: a ``ValueError``."""
    if _types.capturing(like.device):  # (a function, so CPU tests can simulate capture)
        raise ValueError("seed: seed=None draws seeds on the host, which a CUDA graph cannot "
                         "replay (it would reuse one draw forever); pass seed (and offset) as "
                         "[B] int64 tensors when capturing")
    return torch.randint(-2**63, 2**63 - 1, like.shape, dtype=torch.int64).to(like.device)


@_fake("draw_seeds")
def _(like):
    return like.new_empty(like.shape, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Value checks (validate=True)
# ---------------------------------------------------------------------------------------------

# family name -> run(tensors, ints): raises the family's first failing check. Filled by the
# parsing layer above (``_params.check_family``), which owns the messages; the op below only
# looks the family up, so this module imports nothing from that layer.
CHECKS: dict[str, Callable] = {}


@_define("check_values")
def check_values(family: str, tensors: list[Optional[torch.Tensor]], ints: list[int]) -> None:
    """The value checks of a validated call (one read of the small tensors they need): an op,
    so that under ``torch.compile`` they run when the compiled step runs and raise the eager
    error (a traced ``.item()`` would break the graph)."""
    CHECKS[family](tensors, ints)


@_fake("check_values")
def _(family, tensors, ints):
    return None


try:  # no output: keep it in compiled graphs (older torch: a graph's outputs never drop it)
    torch.fx.node.has_side_effect(torch.ops.specdec.check_values.default)
except AttributeError:
    pass


# ---------------------------------------------------------------------------------------------
# Reference backend (the definition, pure PyTorch)
# ---------------------------------------------------------------------------------------------


@_define("reference_processed_probs")
def reference_processed_probs(logits: torch.Tensor, temperature: torch.Tensor,
                              top_k: torch.Tensor, top_p: torch.Tensor,
                              min_p: Optional[torch.Tensor], uses_top_k: bool, uses_top_p: bool,
                              all_greedy: bool, uses_min_p: bool,
                              token_bitmask: Optional[torch.Tensor]) -> torch.Tensor:
    from .reference import sampling
    return sampling.processed_probs(logits, temperature, top_k, top_p, min_p, token_bitmask)


@_fake("reference_processed_probs")
def _(logits, **_):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(logits.shape, dtype=dtype)


@_define("reference_sample")
def reference_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: Optional[torch.Tensor], uses_top_k: bool,
                     uses_top_p: bool, all_greedy: bool, uses_min_p: bool,
                     seeds: torch.Tensor, offsets: torch.Tensor,
                     token_bitmask: Optional[torch.Tensor],
                     return_logprobs: Optional[str]) -> list[torch.Tensor]:
    from .reference import sampling
    result = sampling.sample(logits, temperature, top_k, top_p, seeds, offsets, min_p,
                             token_bitmask, return_logprobs)
    tokens, logprobs = (result, None) if return_logprobs is None else result
    return [tokens, *_logprobs_out(logprobs)]


def _sample_shapes(logits, return_logprobs, **_):
    batch = logits.shape[0]
    return [logits.new_empty((batch,), dtype=torch.int32),
            *_logprobs_fake(logits, (batch,), return_logprobs)]


_fake("reference_sample")(_sample_shapes)


@_define("reference_verify_chain")
def reference_verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                           draft_probs: Optional[torch.Tensor],
                           draft_logits: Optional[torch.Tensor], num_draft_tokens: torch.Tensor,
                           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: Optional[torch.Tensor], uses_top_k: bool, uses_top_p: bool,
                           all_greedy: bool, uses_min_p: bool, seeds: torch.Tensor,
                           offsets: torch.Tensor, token_bitmask: Optional[torch.Tensor],
                           method: str, return_logprobs: Optional[str],
                           draft_slots: Optional[torch.Tensor],
                           draft_temperature: Optional[torch.Tensor]
                           ) -> list[torch.Tensor]:
    from .reference import chain
    out, accepted, logprobs = chain.verify_chain(
        target_logits, draft_token_ids, draft_probs, draft_logits, num_draft_tokens,
        temperature, top_k, top_p, seeds, offsets, min_p=min_p, token_bitmask=token_bitmask,
        return_logprobs=return_logprobs, method=method, draft_slots=draft_slots,
        draft_temperature=draft_temperature)
    return [out, accepted, *_logprobs_out(logprobs)]


def _chain_shapes(target_logits, return_logprobs, batch=None, rows=None, **_):
    if batch is None:
        batch, rows = target_logits.shape[:2]
    return [target_logits.new_empty((batch, rows), dtype=torch.int32),
            target_logits.new_empty((batch,), dtype=torch.int32),
            *_logprobs_fake(target_logits, (batch, rows), return_logprobs)]


_fake("reference_verify_chain")(_chain_shapes)


@_define("reference_verify_chain_packed")
def reference_verify_chain_packed(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                                  cu_num_draft_tokens: torch.Tensor, max_draft_tokens: int,
                                  draft_probs: Optional[torch.Tensor],
                                  draft_logits: Optional[torch.Tensor],
                                  temperature: torch.Tensor, top_k: torch.Tensor,
                                  top_p: torch.Tensor, min_p: Optional[torch.Tensor],
                                  uses_top_k: bool, uses_top_p: bool, all_greedy: bool,
                                  uses_min_p: bool, seeds: torch.Tensor, offsets: torch.Tensor,
                                  token_bitmask: Optional[torch.Tensor], method: str,
                                  return_logprobs: Optional[str],
                                  draft_slots: Optional[torch.Tensor],
                                  draft_temperature: Optional[torch.Tensor]
                                  ) -> list[torch.Tensor]:
    """The packed layout's definition: the padded equivalent (a copy), then the reference
    (slotted draft rows stay ``[S, K', V']``: the padded op reads them through the slots)."""
    from .reference import packed
    layout = packed.packed_layout(cu_num_draft_tokens, draft_token_ids.shape[0],
                                  max_draft_tokens)
    slotted = draft_slots is not None
    target, ids, probs, logits, bitmask = packed.padded_inputs(
        layout, target_logits, draft_token_ids, None if slotted else draft_probs,
        None if slotted else draft_logits, token_bitmask)
    if slotted:
        probs, logits = draft_probs, draft_logits
    return IMPLEMENTATIONS["reference_verify_chain"](
        target, ids, probs, logits, layout.num_draft_tokens,
                                  temperature, top_k, top_p, min_p, uses_top_k, uses_top_p,
                                  all_greedy, uses_min_p, seeds, offsets, bitmask, method,
                                  return_logprobs, draft_slots, draft_temperature)


def _packed_chain_shapes(target_logits, cu_num_draft_tokens, max_draft_tokens,
                         return_logprobs, **_):
    return _chain_shapes(target_logits, return_logprobs, batch=cu_num_draft_tokens.shape[0] - 1,
                         rows=max_draft_tokens + 1)


_fake("reference_verify_chain_packed")(_packed_chain_shapes)


@_define("reference_verify_tree")
def reference_verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor,
                          parents: torch.Tensor, draft_probs: Optional[torch.Tensor],
                          draft_sampling: str, num_nodes: torch.Tensor,
                          temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: Optional[torch.Tensor], uses_top_k: bool, uses_top_p: bool,
                          all_greedy: bool, uses_min_p: bool, seeds: torch.Tensor,
                          offsets: torch.Tensor, token_bitmask: Optional[torch.Tensor],
                          method: str, return_logprobs: Optional[str]
                          ) -> list[torch.Tensor]:
    from .reference import tree
    out, path, accepted, logprobs = tree.verify_tree(
        target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes,
        temperature, top_k, top_p, seeds, offsets, min_p=min_p, token_bitmask=token_bitmask,
        return_logprobs=return_logprobs, method=method)
    return [out, path, accepted, *_logprobs_out(logprobs)]


def _tree_shapes(target_logits, return_logprobs, **_):
    batch, nodes = target_logits.shape[:2]
    return [target_logits.new_empty((batch, nodes), dtype=torch.int32),
            target_logits.new_empty((batch, nodes), dtype=torch.int32),
            target_logits.new_empty((batch,), dtype=torch.int32),
            *_logprobs_fake(target_logits, (batch, nodes), return_logprobs)]


_fake("reference_verify_tree")(_tree_shapes)


@_define("reference_build_tree_attention")
def reference_build_tree_attention(parents: torch.Tensor, num_nodes: Optional[torch.Tensor],
                                   prefix_lens: Optional[torch.Tensor]
                                   ) -> list[torch.Tensor]:
    from .reference import tree_attention
    return list(tree_attention.build_tree_attention(parents, num_nodes=num_nodes,
                                                    prefix_lens=prefix_lens))


def _tree_attention_shapes(parents, **_):
    batch, nodes = parents.shape
    return [parents.new_empty((batch, nodes, nodes), dtype=torch.bool),
            parents.new_empty((batch, nodes, (nodes + 31) // 32), dtype=torch.int32),
            parents.new_empty((batch, nodes), dtype=torch.int32),
            parents.new_empty((batch, nodes), dtype=torch.int64)]


_fake("reference_build_tree_attention")(_tree_attention_shapes)


@_define("reference_compact_kv_cache", mutates_args=("caches",))
def reference_compact_kv_cache(caches: list[torch.Tensor], kv_lens: torch.Tensor,
                               accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                               layout: str) -> torch.Tensor:
    from .reference import kv_cache
    return kv_cache.compact_kv_cache(caches, kv_lens, accepted_nodes, num_accepted,
                                     layout=layout)


def _new_kv_lens_shape(kv_lens, **_):
    return torch.empty_like(kv_lens)


_fake("reference_compact_kv_cache")(_new_kv_lens_shape)


@_define("reference_compact_paged_kv_cache", mutates_args=("caches",))
def reference_compact_paged_kv_cache(caches: list[torch.Tensor], block_tables: torch.Tensor,
                                     kv_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                                     num_accepted: torch.Tensor) -> torch.Tensor:
    from .reference import kv_cache
    return kv_cache.compact_paged_kv_cache(caches, block_tables, kv_lens, accepted_nodes,
                                           num_accepted)


_fake("reference_compact_paged_kv_cache")(_new_kv_lens_shape)


# ---------------------------------------------------------------------------------------------
# Triton backend (CUDA tensors; CPU tensors under TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


@_define("triton_sample")
def triton_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: Optional[torch.Tensor], uses_top_k: bool,
                  uses_top_p: bool, all_greedy: bool, uses_min_p: bool, seeds: torch.Tensor,
                  offsets: torch.Tensor, token_bitmask: Optional[torch.Tensor],
                  return_logprobs: Optional[str]) -> list[torch.Tensor]:
    from .triton import sampling
    params = _sampling_params(temperature, top_k, top_p, min_p, uses_top_k, uses_top_p,
                              all_greedy, uses_min_p)
    result = sampling.sample(logits, params, seeds, offsets, token_bitmask=token_bitmask,
                             return_logprobs=return_logprobs)
    tokens, logprobs = (result, None) if return_logprobs is None else result
    return [tokens, *_logprobs_out(logprobs)]


_fake("triton_sample")(_sample_shapes)


@_define("triton_verify_chain")
def triton_verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                        draft_probs: Optional[torch.Tensor], draft_logits: Optional[torch.Tensor],
                        num_draft_tokens: torch.Tensor, temperature: torch.Tensor,
                        top_k: torch.Tensor, top_p: torch.Tensor, min_p: Optional[torch.Tensor],
                        uses_top_k: bool, uses_top_p: bool, all_greedy: bool, uses_min_p: bool,
                        seeds: torch.Tensor, offsets: torch.Tensor,
                        token_bitmask: Optional[torch.Tensor], method: str,
                        return_logprobs: Optional[str], draft_slots: Optional[torch.Tensor],
                        draft_temperature: Optional[torch.Tensor]
                        ) -> list[torch.Tensor]:
    from .triton import chain
    params = _sampling_params(temperature, top_k, top_p, min_p, uses_top_k, uses_top_p,
                              all_greedy, uses_min_p)
    out, accepted, logprobs = chain.verify_chain(
        target_logits, draft_token_ids, draft_probs, draft_logits, num_draft_tokens, params,
        seeds, offsets, method=method, token_bitmask=token_bitmask,
        return_logprobs=return_logprobs, draft_slots=draft_slots,
        draft_temperature=draft_temperature)
    return [out, accepted, *_logprobs_out(logprobs)]


_fake("triton_verify_chain")(_chain_shapes)


@_define("triton_verify_chain_packed")
def triton_verify_chain_packed(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                               cu_num_draft_tokens: torch.Tensor, max_draft_tokens: int,
                               draft_probs: Optional[torch.Tensor],
                               draft_logits: Optional[torch.Tensor], temperature: torch.Tensor,
                               top_k: torch.Tensor, top_p: torch.Tensor,
                               min_p: Optional[torch.Tensor], uses_top_k: bool,
                               uses_top_p: bool, all_greedy: bool, uses_min_p: bool,
                               seeds: torch.Tensor, offsets: torch.Tensor,
                               token_bitmask: Optional[torch.Tensor], method: str,
                               return_logprobs: Optional[str],
                               draft_slots: Optional[torch.Tensor],
                               draft_temperature: Optional[torch.Tensor]
                               ) -> list[torch.Tensor]:
    from .triton import chain
    params = _sampling_params(temperature, top_k, top_p, min_p, uses_top_k, uses_top_p,
                              all_greedy, uses_min_p)
    out, accepted, logprobs = chain.verify_chain(
        target_logits, draft_token_ids, draft_probs, draft_logits, None, params, seeds,
        offsets, method=method, token_bitmask=token_bitmask, return_logprobs=return_logprobs,
        packed=(cu_num_draft_tokens, max_draft_tokens), draft_slots=draft_slots,
        draft_temperature=draft_temperature)
    return [out, accepted, *_logprobs_out(logprobs)]


_fake("triton_verify_chain_packed")(_packed_chain_shapes)


@_define("triton_verify_tree")
def triton_verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor,
                       parents: torch.Tensor, draft_probs: Optional[torch.Tensor],
                       draft_sampling: str, num_nodes: torch.Tensor, temperature: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, min_p: Optional[torch.Tensor],
                       uses_top_k: bool, uses_top_p: bool, all_greedy: bool, uses_min_p: bool,
                       seeds: torch.Tensor, offsets: torch.Tensor,
                       token_bitmask: Optional[torch.Tensor], method: str,
                       return_logprobs: Optional[str]
                       ) -> list[torch.Tensor]:
    from .triton import tree
    params = _sampling_params(temperature, top_k, top_p, min_p, uses_top_k, uses_top_p,
                              all_greedy, uses_min_p)
    out, path, accepted, logprobs = tree.verify_tree(
        target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes, params,
        seeds, offsets, method=method, token_bitmask=token_bitmask,
        return_logprobs=return_logprobs)
    return [out, path, accepted, *_logprobs_out(logprobs)]


_fake("triton_verify_tree")(_tree_shapes)


# ---------------------------------------------------------------------------------------------
# The compiled extension's ops (schemas in csrc/torch): their fakes
# ---------------------------------------------------------------------------------------------


def _cpp_fake(name: str, signature_of: Callable):
    """Registers a fake for the C++ op ``specdec::<name>`` where ``_C`` defines it (a build
    without it leaves the Python ops above in charge)."""
    def register(shapes):
        if _extension.HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
                f"{NAMESPACE}::{name}", "CPU"):
            _fake(name, signature_of)(shapes)
        return shapes
    return register


# Signatures of the C++ schemas, for the fakes' argument names (kept in the schemas' order).
def _cpu_verify_chain_args(target_logits, draft_token_ids, draft_probs, draft_logits,
                           num_draft_tokens, temperature, top_k, top_p, min_p, token_bitmask,
                           seed, offset, method, logprobs, draft_slots=None,
                           draft_temperature=None): ...


def _cpu_verify_chain_packed_args(target_logits, draft_token_ids, draft_probs, draft_logits,
                                  cu_num_draft_tokens, max_draft_tokens, temperature, top_k,
                                  top_p, min_p, token_bitmask, seed, offset, method,
                                  logprobs, draft_slots=None, draft_temperature=None): ...


def _cpu_sample_args(logits, temperature, top_k, top_p, min_p, token_bitmask, seed, offset,
                     logprobs): ...


def _cpu_verify_tree_args(target_logits, tree_token_ids, parents, draft_probs,
                          without_replacement, num_nodes, temperature, top_k, top_p, min_p,
                          token_bitmask, seed, offset, method, logprobs): ...


def _cpu_processed_probs_args(logits, temperature, top_k, top_p, min_p, token_bitmask): ...


def _build_tree_attention_args(parents, num_nodes, prefix_lens): ...


def _compact_kv_cache_args(caches, kv_lens, accepted_nodes, num_accepted, layout): ...


def _compact_paged_kv_cache_args(caches, block_tables, kv_lens, accepted_nodes,
                                 num_accepted): ...


def _cpp_logprobs(like, shape, logprobs: int) -> torch.Tensor:
    """The C++ ops' logprobs output: ``[0]`` when not asked for (``logprobs == 0``)."""
    return like.new_empty(shape if logprobs else (0,), dtype=torch.float32)


@_cpp_fake("cpu_verify_chain", _cpu_verify_chain_args)
def _(target_logits, logprobs, **_):
    batch, rows = target_logits.shape[:2]
    return (*_chain_shapes(target_logits, None),
            _cpp_logprobs(target_logits, (batch, rows), logprobs))


@_cpp_fake("cpu_verify_chain_packed", _cpu_verify_chain_packed_args)
def _(target_logits, cu_num_draft_tokens, max_draft_tokens, logprobs, **_):
    batch, rows = cu_num_draft_tokens.shape[0] - 1, max_draft_tokens + 1
    return (*_chain_shapes(target_logits, None, batch=batch, rows=rows),
            _cpp_logprobs(target_logits, (batch, rows), logprobs))


@_cpp_fake("cpu_sample", _cpu_sample_args)
def _(logits, logprobs, **_):
    return (*_sample_shapes(logits, None), _cpp_logprobs(logits, (logits.shape[0],), logprobs))


@_cpp_fake("cpu_verify_tree", _cpu_verify_tree_args)
def _(target_logits, logprobs, **_):
    return (*_tree_shapes(target_logits, None),
            _cpp_logprobs(target_logits, target_logits.shape[:2], logprobs))


@_cpp_fake("cpu_processed_probs", _cpu_processed_probs_args)
def _(logits, **_):
    return logits.new_empty(logits.shape, dtype=torch.float32)


_cpp_fake("build_tree_attention", _build_tree_attention_args)(_tree_attention_shapes)
_cpp_fake("compact_kv_cache", _compact_kv_cache_args)(_new_kv_lens_shape)
_cpp_fake("compact_paged_kv_cache", _compact_paged_kv_cache_args)(_new_kv_lens_shape)


def registered_ops() -> list[str]:
    """Every ``specdec::`` op a public call can reach in this build (for tests and docs)."""
    cpp = ["cpu_sample", "cpu_verify_chain", "cpu_verify_chain_packed", "cpu_verify_tree",
           "cpu_processed_probs", "build_tree_attention", "compact_kv_cache",
           "compact_paged_kv_cache"]
    present = [name for name in cpp if _extension.HAS_EXTENSION
               and torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CPU")]
    return sorted(IMPLEMENTATIONS) + present

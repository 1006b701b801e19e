"""Parsing vLLM's V1 step (host only: Python values and tensor shapes): the layout of
``logits`` and the metadata, the sampling parameters, which features a batch uses, the
per-request seeds. Every check that needs no device read runs here, before anything is
written or drawn."""
from __future__ import annotations

import copy
import dataclasses
import numbers
from typing import NamedTuple, Optional

import torch

from ... import _params
from ..._types import device_type
from .._common import seeds_from_generator
from ._types import MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID, SAMPLING_EPS



class Step(NamedTuple):
    batch: int
    num_draft_tokens: list
    max_spec_len: int
    num_packed: int                  # T
    draft_token_ids: torch.Tensor
    cu_exclusive: torch.Tensor       # [B+1] on the device, from the host list
    num_drafts_device: torch.Tensor  # [B] int64
    in_place: bool                   # logits is vLLM's [T+B, V] runner layout
    has_bonus_rows: bool
    vocab: int
    row_request: list                # per packed row
    row_position: list
    slot_rows_device: Optional[torch.Tensor]
    bonus_slots: list
    bonus_slot_requests: list
    max_num_logprobs: Optional[int]
    has_processors: bool
    layout_rows: Optional[tuple]     # in place: the rows of vLLM's target and bonus indices


def parse_step(metadata, draft_probs, logits, sampling_metadata, token_bitmask) -> Step:
    """Every check the step needs, on Python values and shapes only (no device read). What
    the step's structure decides (the tensors' shapes, dtypes and devices, the draft counts,
    ``max_num_logprobs``) is checked and laid out once per structure; what a call's Python
    values can change (the counts' types, ``max_spec_len``, generators, the features' host
    lists, ``spec_token_ids``) is checked on every call."""
    if metadata is None or not all(hasattr(metadata, name) for name in (
            "draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens",
            "target_logits_indices", "bonus_logits_indices")):
        raise TypeError(f"metadata: expected vLLM's SpecDecodeMetadata (draft_token_ids, "
                        f"num_draft_tokens, cu_num_draft_tokens, target_logits_indices, "
                        f"bonus_logits_indices), got {type(metadata).__name__}")
    if sampling_metadata is None or not hasattr(sampling_metadata, "all_greedy"):
        raise TypeError(f"sampling_metadata: expected vLLM's SamplingMetadata, "
                        f"got {type(sampling_metadata).__name__}")
    sm = sampling_metadata
    all_greedy = getattr(sm, "all_greedy", False)
    key = _params.call_key(
        logits, draft_probs, metadata.draft_token_ids, metadata.cu_num_draft_tokens,
        metadata.target_logits_indices, metadata.bonus_logits_indices, token_bitmask,
        getattr(sm, "temperature", None), all_greedy, getattr(sm, "top_k", None),
        getattr(sm, "top_p", None), getattr(sm, "min_p", None),
        getattr(sm, "max_num_logprobs", None)) if type(all_greedy) is bool else None
    if key is not None:
        try:
            key += tuple(host_counts(metadata.num_draft_tokens, "num_draft_tokens"))
        except (TypeError, ValueError):  # raised below, after the checks that come first
            key = None
    if key is not None:
        step = _STEPS.get(key)
        if step is not None:
            check_max_spec_len(metadata, step.max_spec_len)
            check_sampling_host(sm, step.batch, step.vocab, logits.device)
            if draft_probs is not None:
                check_spec_lists(sm, step.batch)
            return step._replace(draft_token_ids=metadata.draft_token_ids,
                                 has_processors=has_processors(sm))
    step = _parse_structure(metadata, draft_probs, logits, sm, token_bitmask)
    if key is not None:
        _params.remember(_STEPS, key, step._replace(draft_token_ids=None))
    return step


_STEPS: dict = {}  # a step's layout by its structure (parse_step)


def check_max_spec_len(metadata, max_spec_len: int) -> None:
    declared = getattr(metadata, "max_spec_len", max_spec_len)
    if isinstance(declared, bool) or not isinstance(declared, numbers.Integral) \
            or int(declared) != max_spec_len:
        raise ValueError(f"max_spec_len: expected max(num_draft_tokens) = {max_spec_len}, "
                         f"got {declared!r}")


def check_spec_lists(sm, batch: int) -> None:
    """With ``draft_probs``, the ``-1`` drafts are found from the host lists."""
    spec = getattr(sm, "spec_token_ids", None)
    # None or [] (vLLM's own tests pass []): no host lists, so no -1 drafts looked for.
    if spec is not None and (isinstance(spec, torch.Tensor) or len(spec) and (
            len(spec) < batch or any(not isinstance(spec[b], (list, tuple))
                                     for b in range(batch)))):
        raise ValueError(f"spec_token_ids: expected one host list of draft ids per "
                         f"request ({batch}) with draft_probs, got "
                         f"{type(spec).__name__}" + ("" if isinstance(spec, torch.Tensor)
                                                     else f" of length {len(spec)}"))


def _parse_structure(metadata, draft_probs, logits, sampling_metadata, token_bitmask) -> Step:
    """The step's checks in order, and its layout."""
    _params.check_tensor(logits, "logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = logits.device
    vocab = logits.shape[1]
    if vocab < 1:
        raise ValueError(f"logits: expected shape [T+B, V] with V >= 1, got {list(logits.shape)}")
    num_draft_tokens = host_counts(metadata.num_draft_tokens, "num_draft_tokens")
    batch = len(num_draft_tokens)
    num_packed = sum(num_draft_tokens)
    max_spec_len = max(num_draft_tokens, default=0)
    check_max_spec_len(metadata, max_spec_len)
    if max_spec_len > MAX_SPEC_LEN:
        raise ValueError(f"num_draft_tokens: expected at most MAX_SPEC_LEN = {MAX_SPEC_LEN} "
                         f"drafts per request, got {max_spec_len}")
    draft_token_ids = metadata.draft_token_ids
    _params.check_tensor(draft_token_ids, "draft_token_ids", ndim=1,
                         dtypes=_params.INDEX_DTYPES, device=device)
    if draft_token_ids.shape[0] != num_packed:
        raise ValueError(f"draft_token_ids: expected sum(num_draft_tokens) = {num_packed} "
                         f"ids, got {draft_token_ids.shape[0]}")
    cu = metadata.cu_num_draft_tokens
    _params.check_tensor(cu, "cu_num_draft_tokens", ndim=1, dtypes=_params.INDEX_DTYPES)
    if cu.shape[0] != batch:
        raise ValueError(f"cu_num_draft_tokens: expected {batch} entries (one per request, "
                         f"as num_draft_tokens), got {cu.shape[0]}")
    target_indices, bonus_indices = metadata.target_logits_indices, metadata.bonus_logits_indices
    for name, index, sizes in (("target_logits_indices", target_indices, (num_packed,)),
                               ("bonus_logits_indices", bonus_indices, (batch, 0))):
        _params.check_tensor(index, name, ndim=1, dtypes=_params.INDEX_DTYPES)
        if index.shape[0] not in sizes:
            raise ValueError(f"{name}: expected {' or '.join(map(str, sizes))} entries, "
                             f"got {index.shape[0]}")
    has_bonus_rows = bonus_indices.shape[0] == batch
    in_place = has_bonus_rows and logits.shape[0] == num_packed + batch
    if draft_probs is not None:
        _params.check_tensor(draft_probs, "draft_probs", ndim=2,
                             dtypes=_params.LOGIT_DTYPES + (torch.float64,), device=device)
        if list(draft_probs.shape) != [num_packed, vocab]:
            raise ValueError(f"draft_probs: expected shape [T, V] = [{num_packed}, {vocab}], "
                             f"got {list(draft_probs.shape)}")
    if token_bitmask is not None:
        _params.check_token_bitmask(token_bitmask, [logits.shape[0]], vocab, device,
                                    "[rows of logits, ceil(V/32)]")
    check_sampling(sampling_metadata, batch, vocab, device)
    if draft_probs is not None:
        check_spec_lists(sampling_metadata, batch)
    max_num_logprobs = getattr(sampling_metadata, "max_num_logprobs", None)
    if max_num_logprobs is not None and (isinstance(max_num_logprobs, bool) or not isinstance(
            max_num_logprobs, numbers.Integral) or not 0 <= max_num_logprobs <= vocab):
        raise ValueError(f"max_num_logprobs: expected None or an int in [0, {vocab}], "
                         f"got {max_num_logprobs!r}")

    row_request, row_position = [], []
    for b, n in enumerate(num_draft_tokens):
        row_request += [b] * (n + 1)
        row_position += list(range(n + 1))
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    cu_exclusive = to_device(starts, device)
    num_drafts_device = to_device(num_draft_tokens, device)
    slot_rows_device, bonus_slots, bonus_slot_requests = None, [], []
    if max_num_logprobs is not None:
        slot_rows = []
        for b, n in enumerate(num_draft_tokens):
            for j in range(max_spec_len + 1):
                slot_rows.append(starts[b] + b + min(j, n))
                if j == n:
                    bonus_slots.append(b * (max_spec_len + 1) + j)
                    bonus_slot_requests.append(b)
        slot_rows_device = to_device(slot_rows, device)
    layout_rows = None
    if in_place:  # (for validate=True: vLLM's indices compared on the device)
        drafts = [j < num_draft_tokens[b] for b, j in zip(row_request, row_position)]
        layout_rows = tuple(to_device([r for r, d in enumerate(drafts) if d == want], device)
                            for want in (True, False))
    return Step(batch, num_draft_tokens, max_spec_len, num_packed, draft_token_ids,
                cu_exclusive, num_drafts_device, in_place, has_bonus_rows, vocab,
                row_request, row_position, slot_rows_device, bonus_slots,
                bonus_slot_requests, max_num_logprobs, has_processors(sampling_metadata),
                layout_rows)


def check_values(step: Step, metadata, logits, sm, offset, params: dict) -> None:
    """``validate=True``: the device values too, in one read (``raise_first_failure``): draft
    ids in ``[-1, V)``, vLLM's runner layout (or in-range indices), the sampling parameters'
    ranges, the prompt ids with penalties; on a failure the first one's error, in this order."""
    device, rows, vocab = logits.device, logits.shape[0], step.vocab
    checks = []
    ids = _params.as_int64(step.draft_token_ids)
    bad_ids = (ids < PLACEHOLDER_TOKEN_ID) | (ids >= vocab)

    def ids_error():
        t = _params.first_true(bad_ids)
        raise ValueError(f"draft_token_ids: expected ids in [0, {vocab}) or -1 (a "
                         f"rejected draft), got {int(ids[t])} at [{t}]")
    checks.append((bad_ids, ids_error))
    cu = _params.as_int64(metadata.cu_num_draft_tokens).to(device)  # (metadata may be on the host)

    def cu_error():
        raise ValueError(f"cu_num_draft_tokens: expected the inclusive sums of "
                         f"num_draft_tokens {step.cu_exclusive.tolist()[1:]}, got {cu.tolist()}")
    checks.append((cu != step.cu_exclusive[1:], cu_error))
    for name, want in zip(("target_logits_indices", "bonus_logits_indices"),
                          step.layout_rows or (None, None)):
        index = _params.as_int64(getattr(metadata, name)).to(device)
        if step.in_place:
            def layout_error(name=name, index=index, want=want):
                raise ValueError(f"{name}: expected vLLM's layout for num_draft_tokens "
                                 f"{step.num_draft_tokens} (each request's draft rows, then "
                                 f"its bonus row), {want.tolist()}, got {index.tolist()}")
            checks.append((index != want, layout_error))
        else:
            def range_error(name=name, index=index):
                raise ValueError(f"{name}, cu_num_draft_tokens: expected row indices in "
                                 f"[0, {rows}) (logits has {rows} rows), got {index.tolist()}")
            checks.append(((index < 0) | (index >= rows), range_error))
    values: list = []
    _params.sampling_params(params["temperature"], params["top_k"], params["top_p"],
                            batch=step.batch, vocab_size=vocab, device=device,
                            validate=True, min_p=params["min_p"], checks=values)
    checks += _params.sampling_checks(*values)
    prompt = getattr(sm, "prompt_token_ids", None)
    if not getattr(sm, "no_penalties", True) and prompt.numel():
        bad_prompt = (prompt < 0) | (prompt > vocab)

        def prompt_error():
            b, i = (int(x) for x in bad_prompt.nonzero()[0])
            raise ValueError(f"prompt_token_ids: expected ids in [0, {vocab}] ({vocab}"
                             f": padding), got {int(prompt[b, i])} at [{b}, {i}]")
        checks.append((bad_prompt.to(device), prompt_error))
    _params.raise_first_failure(checks)
    _params.per_request(_params._as_int64(offset, "offset"), "offset", step.batch, device,
                        torch.int64, 0)


def host_counts(values, name: str) -> list:
    """A host list of non-negative Python ints (vLLM's ``num_draft_tokens``)."""
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a list of Python ints (one per request), "
                        f"got {type(values).__name__}")
    counts = []
    for b, n in enumerate(values):
        if type(n) is int and n >= 0:  # the common case, cheaply
            counts.append(n)
            continue
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name}: expected Python ints, got {n!r} "
                            f"({type(n).__name__}) for request {b}")
        if n < 0:
            raise ValueError(f"{name}: expected counts >= 0, got {n} for request {b}")
        counts.append(int(n))
    return counts


def check_sampling(sm, batch: int, vocab: int, device) -> None:
    temperature = getattr(sm, "temperature", None)
    if temperature is None:
        if not getattr(sm, "all_greedy", False):
            raise ValueError("temperature: expected a [B] tensor unless all_greedy, got None")
    else:
        check_per_request(temperature, "temperature", batch, device)
    for name in ("top_k", "top_p", "min_p"):
        value = getattr(sm, name, None)
        if value is not None:
            check_per_request(value, name, batch, device)
    check_sampling_host(sm, batch, vocab, device)


def check_sampling_host(sm, batch: int, vocab: int, device) -> None:
    """The sampling checks of Python values (generators, the features' host lists and
    tensors): every call's own."""
    generators = getattr(sm, "generators", None) or {}
    if not isinstance(generators, dict):
        raise TypeError(f"generators: expected a dict batch index -> torch.Generator, "
                        f"got {type(generators).__name__}")
    for index, generator in generators.items():
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) \
                or not 0 <= index < batch:
            raise ValueError(f"generators: expected batch indices in [0, {batch}), "
                             f"got {index!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generators: expected torch.Generator values, got "
                            f"{type(generator).__name__} at batch index {index}")
    penalised = not getattr(sm, "no_penalties", True)
    bad_words = getattr(sm, "bad_words_token_ids", None) or {}
    if penalised or bad_words:
        spec = getattr(sm, "spec_token_ids", None)
        output = getattr(sm, "output_token_ids", None)
        for name, lists in (("spec_token_ids", spec), ("output_token_ids", output)):
            if lists is None or isinstance(lists, torch.Tensor) or len(lists) < batch:
                raise ValueError(f"{name}: expected one host list per request ({batch}) for "
                                 f"penalties and bad words, got {type(lists).__name__}"
                                 + ("" if lists is None else f" of length {len(lists)}"))
    if penalised:
        prompt = getattr(sm, "prompt_token_ids", None)
        if prompt is None:
            raise ValueError("prompt_token_ids: expected a [B, P] tensor with penalties, "
                             "got None")
        _params.check_tensor(prompt, "prompt_token_ids", ndim=2, dtypes=_params.INDEX_DTYPES)
        if prompt.shape[0] < batch:
            raise ValueError(f"prompt_token_ids: expected shape [>= {batch}, P] (one row per "
                             f"request, padded with V), got {list(prompt.shape)}")
        for name in ("frequency_penalties", "presence_penalties", "repetition_penalties"):
            check_per_request(getattr(sm, name, None), name, batch, device, real=True)
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None:
        _params.check_tensor(mask, "allowed_token_ids_mask", ndim=2, dtypes=(torch.bool,),
                             device=device)
        if mask.shape[0] < batch or mask.shape[1] != vocab:
            raise ValueError(f"allowed_token_ids_mask: expected shape [>= {batch}, {vocab}], "
                             f"got {list(mask.shape)}")
    _check_feature_ids(sm, batch, vocab, penalised)


def check_per_request(value, name: str, batch: int, device, *, real: bool = False) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a [B] tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {value.device}")
    if value.reshape(-1).shape[0] < batch:
        raise ValueError(f"{name}: expected {batch} entries (one per request), "
                         f"got shape {list(value.shape)}")
    if real and (value.dtype == torch.bool or value.is_complex()):
        raise TypeError(f"{name}: expected a real-valued tensor, got dtype {value.dtype}")


def _check_token_ids(ids, name: str, vocab: int, where: str, low: int = 0,
                     types: bool = True) -> None:
    """Host token ids in ``[low, V)`` (and Python ints, with ``types``): a ValueError naming
    ``name`` (an id past V would be an IndexError after partial writes, a negative one a
    silent write to token ``V - k``)."""
    try:
        ids = list(ids)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)] \
            if types else []
        if not bad and ids and low <= min(ids) and max(ids) < vocab:
            return
    except TypeError:
        raise TypeError(f"{name}: expected a list of Python int token ids {where}, got "
                        f"{type(ids).__name__}") from None
    if bad:
        raise TypeError(f"{name}: expected Python int token ids, got {bad[0]!r} "
                        f"({type(bad[0]).__name__}) {where}")
    if ids:
        t = next(t for t in ids if not low <= t < vocab)
        raise ValueError(f"{name}: expected token ids in [{low}, {vocab}), got {t} {where}")


def _check_feature_ids(sm, batch: int, vocab: int, with_history: bool) -> None:
    """The token ids the features write at (bad words, logit bias, min tokens' stop tokens)
    and, ``with_history`` (penalties: the ids are counted, a negative one would count as token
    0), read: host lists, all checked before any row is written. Bad words only compare the
    histories, so any id is harmless there."""
    if with_history:
        for name, lists, low in (("output_token_ids", getattr(sm, "output_token_ids", None), -1),
                                 ("spec_token_ids", getattr(sm, "spec_token_ids", None), -1)):
            for b in range(batch):
                _check_token_ids(lists[b], name, vocab, f"for request {b} (-1: a placeholder)",
                                 low, types=False)  # read only: compared and counted
    bad_words = getattr(sm, "bad_words_token_ids", None) or {}
    if not isinstance(bad_words, dict):
        raise TypeError(f"bad_words_token_ids: expected a dict batch index -> list of words, "
                        f"got {type(bad_words).__name__}")
    for b, words in bad_words.items():
        if words is not None and not isinstance(words, (list, tuple)):
            raise TypeError(f"bad_words_token_ids: expected a list of words (lists of token "
                            f"ids) per request, got {type(words).__name__} for request {b}")
        for word in words or ():
            if isinstance(word, (list, tuple)) and not word:
                raise ValueError(f"bad_words_token_ids: expected non-empty words, got [] for "
                                 f"request {b}")
            _check_token_ids(word, "bad_words_token_ids", vocab, f"in request {b}'s word")
    for processor in processors(sm, "non_argmax_invariant"):
        if is_min_tokens(processor) and processor.min_toks:
            if not isinstance(processor.min_toks, dict):
                raise TypeError(f"min_tokens: expected a dict batch index -> (min_tokens, "
                                f"output, stop token ids), got {type(processor.min_toks).__name__}")
            for b, entry in processor.min_toks.items():
                if not isinstance(entry, (list, tuple)) or len(entry) < 3 \
                        or isinstance(entry[0], bool) or not isinstance(entry[0], numbers.Real) \
                        or not hasattr(entry[1], "__len__"):
                    raise TypeError(f"min_tokens: expected (min_tokens, output, stop token ids"
                                    f"[, structured]) per request, got {entry!r} for request {b}")
                _check_token_ids(entry[2], "min_tokens", vocab, f"(stop tokens) for request {b}")
        elif is_logit_bias(processor) and processor.biases:
            for b, biases in processor.biases.items():
                biases = biases or {}
                if not isinstance(biases, dict):
                    raise TypeError(f"logit_bias: expected a dict token id -> bias per request, "
                                    f"got {type(biases).__name__} for request {b}")
                _check_token_ids(biases.keys(), "logit_bias", vocab, f"for request {b}")
                for token, bias in biases.items():
                    if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
                        raise TypeError(f"logit_bias: expected real biases, got {bias!r} for "
                                        f"token {token} of request {b}")


def check_op_arguments(params: dict, seed, offset, batch: int, vocab: int, device) -> None:
    """What the op checks without a device read -- the sampling parameters' types and shapes,
    the seeds' and offsets' -- here, before any row is written, the bonus ``Sampler`` runs or
    a generator advances (the op then checks them again, as it checks every caller)."""
    _params.sampling_params(params["temperature"], params["top_k"], params["top_p"],
                            batch=batch, vocab_size=vocab, device=device, validate=False,
                            min_p=params["min_p"])
    if not _params._ready(offset, batch, device):
        _params.per_request(_params._as_int64(offset, "offset"), "offset", batch, device,
                            torch.int64, 0)
    if seed is not None and not isinstance(seed, _params.DeferredSeeds) \
            and not _params._ready(seed, batch, device):
        _params.per_request(_params._as_int64(seed, "seed"), "seed", batch, device,
                            torch.int64, 0)


def to_device(values: list, device, dtype=torch.int64) -> torch.Tensor:
    """A host list on ``device`` without waiting (pinned staging where CUDA is involved)."""
    host = torch.tensor(values, dtype=dtype)
    if device_type(device) == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def replace(sampling_metadata, **changes):
    if dataclasses.is_dataclass(sampling_metadata):
        return dataclasses.replace(sampling_metadata, **changes)
    clone = copy.copy(sampling_metadata)
    for name, value in changes.items():
        setattr(clone, name, value)
    return clone


# --------------------------------------------------------------------------------------------
# What a batch uses

def processors(sm, kind: str) -> list:
    return list(getattr(getattr(sm, "logitsprocs", None), kind, None) or ())


def is_min_tokens(p) -> bool:
    return hasattr(p, "min_toks") and hasattr(p, "apply_with_spec_decode")


def is_logit_bias(p) -> bool:
    return isinstance(getattr(p, "biases", None), dict)


def is_min_p(p) -> bool:
    return hasattr(p, "min_p_count") and hasattr(p, "min_p")


def thinking_budget(sm):
    holder = getattr(sm, "thinking_budget_state_holder", None)
    return holder if holder is not None and holder.has_tracked_requests() else None


def has_processors(sm) -> bool:
    return bool(not getattr(sm, "no_penalties", True)
                or getattr(sm, "allowed_token_ids_mask", None) is not None
                or getattr(sm, "bad_words_token_ids", None)
                or any(is_min_tokens(p) and p.min_toks or is_logit_bias(p) and p.biases
                       for p in processors(sm, "non_argmax_invariant"))
                or thinking_budget(sm) is not None)


def fusable(sm) -> bool:
    """Whether every feature this batch uses for its bonus token is one we fuse."""
    if getattr(sm, "logprob_token_ids", None) or thinking_budget(sm) is not None:
        return False
    if not all(is_min_tokens(p) or is_logit_bias(p)
               for p in processors(sm, "non_argmax_invariant")):
        return False
    return all(is_min_p(p) for p in processors(sm, "argmax_invariant"))


def packed_rows(step: Step, metadata, logits, token_bitmask):
    """``logits`` itself in vLLM's runner layout; otherwise its rows gathered into it."""
    if step.in_place:
        return logits, token_bitmask
    device = logits.device
    target_rows = [r for r, j in enumerate(step.row_position)
                   if j < step.num_draft_tokens[step.row_request[r]]]
    bonus_rows = [r for r, j in enumerate(step.row_position)
                  if j == step.num_draft_tokens[step.row_request[r]]]
    target_rows, bonus_rows = to_device(target_rows, device), to_device(bonus_rows, device)
    sources = [(target_rows, metadata.target_logits_indices.to(device, torch.int64))]
    if step.has_bonus_rows:
        sources.append((bonus_rows, metadata.bonus_logits_indices.to(device, torch.int64)))

    def gather(x):
        packed = x.new_zeros((step.num_packed + step.batch,) + tuple(x.shape[1:]))
        if x is token_bitmask:
            packed.fill_(-1)  # rows without a source allow every token
        for rows, source in sources:
            packed.index_copy_(0, rows, x[source])
        return packed
    return gather(logits), None if token_bitmask is None else gather(token_bitmask)


# --------------------------------------------------------------------------------------------
# Parameters and seeds

def step_params(sm, batch: int) -> dict:
    temperature = getattr(sm, "temperature", None)
    if getattr(sm, "all_greedy", False) or temperature is None:
        temperature = 0.0
    else:
        temperature = _first(temperature, batch)
        # vLLM's greedy rows: below its epsilon (-1 or 0, by version)
        temperature = temperature.masked_fill(temperature < SAMPLING_EPS, 0.0)

    def first(name):
        value = getattr(sm, name, None)
        return None if value is None else _first(value, batch)
    return dict(temperature=temperature, top_k=first("top_k"), top_p=first("top_p"),
                min_p=min_p_of(sm, batch))


def _first(value: torch.Tensor, batch: int) -> torch.Tensor:
    """The first ``batch`` entries of a per-request tensor (vLLM's may be longer or 2-D)."""
    if value.dim() == 1 and value.shape[0] == batch:
        return value
    return value.reshape(-1)[:batch]


def min_p_of(sm, batch: int) -> Optional[torch.Tensor]:
    """``min_p`` from the field (ours) or vLLM's ``MinPLogitsProcessor``."""
    min_p = getattr(sm, "min_p", None)
    if min_p is not None:
        return _first(min_p, batch)
    for processor in processors(sm, "argmax_invariant"):
        if is_min_p(processor):
            # Its [B, 1] slice is current only while some request uses min_p.
            return processor.min_p.reshape(-1)[:batch] if processor.min_p_count else None
    return None


def request_seeds(sm, seed, batch: int, device):
    """``seed`` if given; else one seed per request, from its own generator where vLLM has
    one (seeded requests) and from the device's default generator otherwise -- drawn by the
    op once it has checked its arguments (``DeferredSeeds``): a rejected call advances no
    generator, and nothing is read back to the host."""
    if seed is not None:
        return seed
    generators = getattr(sm, "generators", None) or {}

    def draw() -> torch.Tensor:
        seeds = torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=device)
        for index, generator in generators.items():
            seeds[index:index + 1] = seeds_from_generator(generator, 1, device)
        return seeds
    return _params.DeferredSeeds(draw)

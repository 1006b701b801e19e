"""The draft-aware history (vLLM's ``_combine_outputs_with_spec_tokens``): the output a token
generated at draft row ``j`` follows is the request's output so far, then its drafts
``1..j``. Penalties and bad words read it; the bonus row, position ``n``, follows every draft."""
from __future__ import annotations


def row_history(output_token_ids, spec_token_ids, request: int, position: int) -> list:
    """The output a token generated at ``position`` of ``request``'s chain follows: its
    output so far, then its drafts ``1..position`` (vLLM's ``_combine_outputs_with_spec_tokens``
    for draft rows; the bonus row, position ``n``, follows every draft)."""
    past = list(output_token_ids[request]) if request < len(output_token_ids) else []
    if request < len(spec_token_ids):
        past += list(spec_token_ids[request][:position])
    return past


def bad_word_bans(live, bad_words: dict, output_token_ids, spec_token_ids):
    """``(rows, tokens)`` that vLLM's bad words ban: at each live ``(row, request, position)``
    the last token of every word whose other tokens end the row's history."""
    banned_rows, banned_tokens = [], []
    for r, b, j in live:
        words = bad_words.get(b)
        if not words:
            continue
        past = row_history(output_token_ids, spec_token_ids, b, j)
        for word in words:
            prefix = len(word) - 1
            if prefix > len(past):
                continue
            if prefix == 0 or list(past[-prefix:]) == list(word[:prefix]):
                banned_rows.append(r)
                banned_tokens.append(word[-1])
    return banned_rows, banned_tokens


def penalty_histories(row_request, row_position, num_draft_tokens, output_token_ids,
                      spec_token_ids, bonus: bool, vocab: int) -> list:
    """Per packed row its history for the penalties (``-1`` drafts as ``vocab``, a token no
    count sees); empty for the rows that get no features (the bonus rows unless ``bonus``)."""
    return [[vocab if t == -1 else int(t)
             for t in row_history(output_token_ids, spec_token_ids, b, j)]
            if j < num_draft_tokens[b] or bonus else []
            for b, j in zip(row_request, row_position)]

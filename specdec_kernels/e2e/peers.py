"""transformers' own decoding on the same prompts: plain ``generate``, prompt lookup
(``prompt_lookup_num_tokens``) and assisted generation with the same draft model. One request
at a time (assisted generation takes batch 1)."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

PEERS = ("hf_plain", "hf_prompt_lookup", "hf_assisted")


def hf_generate(model, requests: Sequence, sampling, peer: str, *, draft_model=None,
                eos_token_id: Optional[int] = None,
                prompt_lookup_num_tokens: int = 10) -> tuple[list[list[int]], float]:
    """(generated tokens per request, wall seconds) with ``model.generate``."""
    if peer not in PEERS:
        raise ValueError(f"peer: expected one of {PEERS}, got {peer!r}")
    extra: dict = {}
    if peer == "hf_prompt_lookup":
        extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    elif peer == "hf_assisted":
        if draft_model is None:
            raise ValueError("draft_model: hf_assisted needs the draft model, got None")
        extra["assistant_model"] = draft_model
    if sampling.greedy:
        extra.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        extra.update(do_sample=True, temperature=sampling.temperature,
                     top_k=sampling.top_k or None, top_p=sampling.top_p)
    outputs, wall = [], 0.0
    for request in requests:
        ids = torch.tensor([request.prompt], device=next(model.parameters()).device)
        stop = {} if request.stop_at_eos else {"min_new_tokens": request.max_new_tokens}
        torch.manual_seed(request.seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=request.max_new_tokens,
                                 eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                                 **stop, **extra)
        wall += time.perf_counter() - start
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs, wall

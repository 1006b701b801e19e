"""The decode loop: a static batch of requests, drafted, verified by the target in one forward
per step, committed with our verify ops and ``compact_kv_cache``.

Per request the loop keeps ``kv_lens[b]`` committed positions in the target's cache and one
*pending* token (emitted, not yet in the cache). A step feeds ``[pending, drafts...]`` at
``kv_lens[b] + node`` (node 0 is the pending token, the tree's root), so row ``i`` of the
target's logits is the distribution after node ``i``'s path: exactly a chain's
``num_draft[b] + 1`` rows (the forward is packed: request ``b``'s own rows only, in
``verify_chain_packed``'s order) and ``verify_tree``'s ``N`` rows. The accepted path is
then moved to the front of the speculative region (``compact_kv_cache``, layout ``"bhsd"``;
a chain's path is already there), ``kv_lens += num_accepted + 1`` and the correction/bonus
token becomes pending.

Only the public API of :mod:`specdec_kernels` is used; a verification ``method`` is passed
through to the verify op when it takes one (see :func:`verify_methods`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import torch

import specdec_kernels as sk

from .adaptive import AdaptiveLength, match_context
from .config import (PhaseClock, Request, Result, Sampling, Speculation, Stats, check_run,
                     tree_size)
from .drafters import ModelDrafter, NgramDrafter, NgramTrieDrafter
from .model import SlotCache, chain_visibility, forward_block, prefill
from .plans import DraftPlan
from .verify import methods_for, unpack_rows, verify_step


def generate(target, requests: Sequence[Request], sampling: Sampling = Sampling(),
             speculation: Speculation = Speculation(), *, draft_model=None,
             eos_token_id: Optional[int] = None, keep_cache: bool = False,
             planted_bug: Optional[str] = None,
             policy: Optional[AdaptiveLength] = None) -> Result:
    """Generate for a static batch of requests; finished requests leave the batch.

    ``keep_cache``: return each request's committed K/V (to check them against a
    recomputation). ``planted_bug``: a deliberate error for the tests to catch
    (``"rows_one_late"``: each draft is checked against the target row one position late).
    ``policy``: with adaptive lengths, the :class:`AdaptiveLength` of an earlier call
    (``Result.policy``) to go on with: what it learnt of costs and contexts is kept, as a
    server's policy would across requests; default a new one."""
    # No autograd bookkeeping on any op (transformers' generate runs under no_grad).
    with torch.inference_mode():
        return _generate(target, requests, sampling, speculation, draft_model, eos_token_id,
                         keep_cache, planted_bug, policy)


def _generate(target, requests, sampling, speculation, draft_model, eos_token_id, keep_cache,
              planted_bug, policy) -> Result:
    device = next(target.parameters()).device
    spec = speculation
    check_run(requests, sampling, spec, target.get_input_embeddings().num_embeddings)
    check_speculation(spec)
    batch = len(requests)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + max_nodes(spec) + 2
    stats = Stats()
    profile = stats.profile
    start, cpu_start = time.perf_counter(), time.process_time()
    clock = PhaseClock(profile)
    cache = SlotCache(batch, capacity)
    kv_lens = prefill(target, cache, [r.prompt for r in requests], device)
    clock.lap("prefill")
    pending = torch.tensor([r.prompt[-1] for r in requests], dtype=torch.long, device=device)
    history = [list(r.prompt) for r in requests]
    generated: list[list[int]] = [[] for _ in requests]
    live = list(range(batch))           # request index of each batch row
    steps = [0] * batch                 # per request: verify calls so far (the Philox offset)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long)
    drafter = None
    clock.lap("python")
    if spec.trie:
        drafter = NgramTrieDrafter(spec.ngram_max, spec.trie_nodes,
                                   int(spec.num_draft_tokens))
    elif spec.drafter == "ngram":
        drafter = NgramDrafter(spec.ngram_max)
    elif spec.drafter == "model":
        if draft_model is None:
            raise ValueError("draft_model: expected a model for drafter='model', got None")
        drafter = ModelDrafter(draft_model, [r.prompt for r in requests], capacity, device,
                               sampling, spec, seed=requests[0].seed)
    clock.lap("drafting")  # the draft model's prefill
    # A draft model pays a forward per draft level: its probes draft one token.
    model_drafts = spec.drafter == "model"
    adaptive = None
    if spec.adaptive and policy is not None:
        adaptive = policy
        adaptive.start(batch)
    elif spec.adaptive:
        adaptive = AdaptiveLength(batch, spec.max_draft_tokens, calibrate=True,
                                  draft_cost_per_level=model_drafts,
                                  probe_length=1 if model_drafts else 4)
    latency = [0.0] * batch
    kept = [None] * batch
    sample_kwargs = sampling.kwargs()
    plain_visible, plain_depth = chain_visibility(batch, 1, device)

    while live:
        if sampling.greedy and drafter is None:  # plain greedy decoding draws nothing
            step_seeds = offsets = None
        else:
            step_seeds = seeds[live].to(device)
            offsets = torch.tensor([steps[i] for i in live], dtype=torch.long, device=device)
        clock.lap("python")
        remaining = [requests[i].max_new_tokens - len(generated[i]) for i in live]
        drafting_before = profile["drafting"]
        plan = plan_step(spec, drafter, adaptive, history, live, remaining, pending, kv_lens,
                         step_seeds, offsets, clock)
        if plan is None and drafter is not None and hasattr(drafter, "skip"):
            drafter.skip(pending)
        clock.lap("drafting")
        # This step's drafting (the policy's cost per draft level), not the run's total.
        draft_seconds = profile["drafting"] - drafting_before
        committed_before = profile["drafting"]
        verify_start = time.perf_counter()
        if plan is None:  # plain decoding
            logits = forward_block(target, cache, pending[:, None], kv_lens,
                                   plain_visible[:len(live)], plain_depth[:len(live)],
                                   profile=profile)
            clock.skip()
            if sampling.greedy:  # what sk.sample returns at temperature 0, without its pass
                emitted = logits[:, 0].argmax(-1)
            else:
                emitted = sk.sample(logits[:, 0], seed=step_seeds, offset=offsets,
                                    **sample_kwargs)
            clock.lap("verify_op")
            out = emitted[:, None]
            num_accepted = torch.zeros(len(live), dtype=torch.long, device=device)
            new_kv_lens = kv_lens + 1
        else:
            nodes = torch.cat([pending[:, None], plan.tokens.clamp_min(0)], 1)
            clock.lap("python")
            # A chain's forward is packed: request b's num_draft[b] + 1 rows only; so is a
            # trie's (its num_nodes[b] real nodes come first).
            lengths = (plan.num_draft + 1 if not plan.is_tree
                       else plan.num_nodes if plan.depths is not None else None)
            logits = forward_block(target, cache, nodes, kv_lens, plan.visible, plan.depth,
                                   lengths=lengths, profile=profile)
            clock.skip()
            if plan.is_tree and lengths is not None:  # verify_tree reads [B, N, V]
                logits = unpack_rows(logits, lengths, nodes.shape[1])
                clock.lap("python")
            out, num_accepted, new_kv_lens = verify_step(
                logits, plan, cache, kv_lens, sampling, spec, step_seeds, offsets, planted_bug,
                profile)
            clock.skip()
            if drafter is not None and hasattr(drafter, "commit"):
                drafter.commit(plan, kv_lens, num_accepted, out)
                clock.lap("drafting")
        verify_end = time.perf_counter()
        commit_s = profile["drafting"] - committed_before
        stats.steps += 1
        counts = (num_accepted + 1).tolist()
        out_list = out.tolist()
        accepted_list = num_accepted.tolist()
        finished_rows = []
        for row, i in enumerate(live):
            steps[i] += 1
            stats.request_steps += 1
            stats.accepted += accepted_list[row]
            if plan is not None:
                for depth_index, drafted in enumerate(plan.drafted_by_depth(row)):
                    stats.position(depth_index, drafted, int(accepted_list[row] > depth_index))
            new = out_list[row][:counts[row]]
            request = requests[i]
            done = False
            for token in new:
                generated[i].append(token)
                history[i].append(token)
                if len(generated[i]) >= request.max_new_tokens or (
                        request.stop_at_eos and token == eos_token_id):
                    done = True
                    break
            if done:
                finished_rows.append(row)
                latency[i] = time.perf_counter() - start
        clock.lap("python")
        if adaptive is not None:
            if plan is not None:
                for row in range(len(live)):
                    adaptive.observe(row, plan.num_drafted(row), accepted_list[row])
                adaptive.observe_cost(int(plan.num_draft.sum()) + len(live),
                                      verify_end - verify_start - commit_s,
                                      draft_seconds + commit_s, int(plan.num_draft.max()))
            else:
                adaptive.observe_cost(len(live), verify_end - verify_start)
            clock.lap("policy")
        pending = out.gather(1, num_accepted[:, None]).squeeze(1).to(torch.long)
        kv_lens = new_kv_lens.to(torch.long)
        if finished_rows:
            clock.lap("python")
            if keep_cache:
                for row in finished_rows:  # positions past the stop were never emitted
                    i = live[row]
                    n = len(requests[i].prompt) + len(generated[i]) - 1
                    kept[i] = [t[row, :, :n].clone() for t in cache.tensors()]
            keep = [r for r in range(len(live)) if r not in set(finished_rows)]
            if keep:
                rows = torch.tensor(keep, dtype=torch.long, device=device)
                cache.select(rows)
                kv_lens, pending = kv_lens[rows], pending[rows]
                clock.lap("compaction")
                if drafter is not None and hasattr(drafter, "select"):
                    drafter.select(rows)
                    clock.lap("drafting")
                if adaptive is not None:
                    adaptive.select(keep)
                    clock.lap("policy")
            live = [live[r] for r in keep]
    clock.lap("python")
    stats.wall_s = time.perf_counter() - start
    stats.cpu_s = time.process_time() - cpu_start
    stats.draft_s = profile["drafting"]
    stats.verify_s = sum(profile[p] for p in ("forward", "masks", "cache_writes", "verify_op",
                                                "compaction"))
    stats.tokens = sum(len(g) for g in generated)
    stats.latency_s = latency
    return Result(generated, stats, kept if keep_cache else None, adaptive)


def warm_up(target, requests: Sequence[Request], *, draft_model=None,
            eos_token_id: Optional[int] = None, max_new_tokens: int = 6) -> float:
    """A few tokens of plain decoding and of each drafter, greedy and sampled, before anything
    is timed: first calls pay one-time setup (thread pool, allocator, kernel choice), which
    would otherwise be charged to whichever run comes first (the plain baseline). Seconds."""
    start = time.perf_counter()
    short = [dataclasses.replace(r, max_new_tokens=max_new_tokens) for r in requests]
    specs = [Speculation(), Speculation("ngram", 2)]
    if draft_model is not None:
        specs += [Speculation("model", 2), Speculation("model", 0, tree=(2, 1))]
    for spec in specs:
        for sampling in (Sampling(), Sampling(1.0)):
            generate(target, short, sampling, spec, draft_model=draft_model,
                     eos_token_id=eos_token_id)
    return time.perf_counter() - start


def check_speculation(spec: Speculation) -> None:
    """What :func:`~.config.check_run` cannot see: the combinations a loop does not take
    (adaptive trees, a trie without the n-gram drafter) and a method the installed op lacks."""
    if spec.adaptive and (spec.tree or spec.trie):
        raise ValueError(f"num_draft_tokens: 'adaptive' is for chains; got a tree "
                         f"(tree={spec.tree}, trie_nodes={spec.trie_nodes})")
    if spec.trie_nodes and (spec.drafter != "ngram" or spec.tree):
        raise ValueError(f"trie_nodes: an n-gram trie needs drafter='ngram' and no tree, got "
                         f"drafter={spec.drafter!r}, tree={spec.tree}")
    if spec.drafter != "none" and spec.method not in methods_for(spec):
        raise ValueError(f"speculation.method: expected one of {methods_for(spec)} for this "
                         f"speculation, got {spec.method!r}")


def max_nodes(spec: Speculation) -> int:
    """The most nodes a step feeds per request (the pending token and its drafts)."""
    if spec.drafter == "none":
        return 1
    if spec.tree:
        return tree_size(spec.tree)
    if spec.trie:
        return spec.trie_nodes + 1
    k = spec.max_draft_tokens if spec.adaptive else int(spec.num_draft_tokens)
    return k + 1


def plan_step(spec, drafter, adaptive, history, live, remaining, pending, kv_lens, seeds,
              offsets, clock: PhaseClock) -> Optional[DraftPlan]:
    """This step's drafts for the rows ``live`` (indices into ``history``), or None (plain)."""
    if drafter is None:
        return None
    if spec.tree:
        return drafter.draft_tree(spec.tree, kv_lens, pending, seeds, offsets)
    if spec.trie:
        return drafter.plan([history[i] for i in live], kv_lens)
    cap = spec.max_draft_tokens if adaptive is not None else int(spec.num_draft_tokens)
    ngram = isinstance(drafter, NgramDrafter)
    found = [drafter.propose_with_match(history[i], cap) for i in live] if ngram else None
    proposals = [p for p, _ in found] if ngram else None
    if adaptive is not None:
        available = [len(p) for p in proposals] if ngram else [cap] * len(live)
        contexts = [match_context(m) for _, m in found] if ngram else None
        clock.lap("drafting")
        lengths = adaptive.choose(available, contexts, remaining)
        clock.lap("policy")
    else:
        lengths = [cap] * len(live)
    if ngram:
        plan = drafter.plan([p[:k] for p, k in zip(proposals, lengths)], pending.device)
    else:
        plan = drafter.draft_chain(lengths, kv_lens, pending, seeds, offsets)
    if plan is not None and plan.tokens.shape[1] == 0:
        return None
    return plan


def cache_recompute_error(target, request: Request, tokens: list[int],
                          kept: list[torch.Tensor]) -> float:
    """Max |K/V| difference between a kept committed cache and a fresh prefill of
    prompt + emitted tokens (all but the last emitted token are committed)."""
    device = next(target.parameters()).device
    sequence = list(request.prompt) + tokens
    committed = kept[0].shape[1]
    fresh = SlotCache(1, committed + 2)
    prefill(target, fresh, [sequence[:committed + 1]], device)
    worst = 0.0
    for old, new in zip(kept, fresh.tensors()):
        worst = max(worst, float((old - new[0, :, :committed]).abs().max()))
    if not math.isfinite(worst):
        return float("inf")
    return worst

"""Drafters: n-gram prompt lookup (deterministic, one-hot ``q``) as a chain or as a trie of
several matches' continuations, and a draft model (any causal LM with the target's
tokenizer) drafting chains and trees with its real ``q``."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

import specdec_kernels as sk

from .model import SlotCache, chain_visibility, forward_block, prefill
from .plans import DraftPlan, TreeShape, chain_plan, deterministic_tree_plan

DRAFT_SEED = 0x5EED_D4AF7  # the drafter's sample stream is keyed by seed + this
NODE_OFFSETS = 1 << 10     # Philox offsets per step for the drafter's nodes


class NgramDrafter:
    """Prompt lookup: the continuation of the most recent earlier occurrence of the last
    ``n`` tokens (``n = ngram_max .. 1``) in the request's prompt and output."""

    def __init__(self, ngram_max: int = 3):
        self.ngram_max = ngram_max

    def propose(self, history: Sequence[int], length: int) -> list[int]:
        return self.propose_with_match(history, length)[0]

    def propose_with_match(self, history: Sequence[int], length: int,
                           longest: int = 32) -> tuple[list[int], int]:
        """(the proposal, how many tokens its occurrence matches the history's end by, at
        most ``longest``: a long match tends to go on being copied)."""
        if length <= 0 or len(history) < 2:
            return [], 0
        tokens = np.asarray(history, dtype=np.int64)
        # Earlier positions p holding the last token; an n-gram match also needs the n - 1
        # tokens before p to equal the history's (one vector compare per extra token).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.ngram_max, len(tokens) - 1), 0, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[tokens[hits - back] == tokens[-1 - back]]
            if hits.size:
                end = int(hits[-1])
                match = n
                while (match < longest and end - match >= 0
                       and history[end - match] == history[-1 - match]):
                    match += 1
                return tokens[end + 1:end + 1 + length].tolist(), match
        return [], 0

    def plan(self, proposals: Sequence[Sequence[int]], device) -> DraftPlan:
        """The chain plan of one proposal per request (``-1`` padded to the longest)."""
        width = max(len(p) for p in proposals)
        tokens = torch.full((len(proposals), width), -1, dtype=torch.long)
        for b, p in enumerate(proposals):
            tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        num_draft = torch.tensor([len(p) for p in proposals], dtype=torch.long)
        return chain_plan(tokens.to(device), num_draft.to(device))


def match_starts(history: Sequence[int], ngram_max: int, limit: int) -> list[int]:
    """Where the continuations of the earlier matches of the history's suffix start: for
    ``n = ngram_max .. 1``, every earlier occurrence of the last ``n`` tokens, most recent
    first, each position once (an ``n``-gram match is also an ``(n-1)``-gram one), at most
    ``limit``. The first is :meth:`NgramDrafter.propose`'s."""
    if len(history) < 2 or limit <= 0:
        return []
    tokens = np.asarray(history, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    starts: list[int] = []
    seen: set = set()
    for n in range(min(ngram_max, len(tokens) - 1), 0, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            hits = hits[tokens[hits - back] == tokens[-1 - back]]
        for end in hits[::-1].tolist():
            if end not in seen:
                seen.add(end)
                starts.append(end + 1)
                if len(starts) >= limit:
                    return starts
    return starts


def resync_starts(history: Sequence[int], ngram_max: int) -> list[int]:
    """Where a copy resumes after its last token broke it. The history without that token
    has an earlier match (:func:`match_starts`' first) predicting the token at ``p``; when
    the last token is another one, the copy resumes at ``p`` if the token was inserted
    (a line break a reformatting adds) or at ``p + 1`` if it replaced the predicted one (an
    edited value), in that order. Empty when nothing was predicted or the prediction held
    (the suffix match then goes on with the copy)."""
    if len(history) < 3:
        return []
    predicted = match_starts(history[:-1], ngram_max, 1)
    if not predicted or history[predicted[0]] == history[-1]:
        return []
    p = predicted[0]
    return [start for start in (p, p + 1) if start < len(history) - 1]


def trie_starts(history: Sequence[int], ngram_max: int, limit: int) -> list[int]:
    """The trie's continuations, in the order they enter it: the chain drafter's match,
    then :func:`resync_starts`, then the other matches of :func:`match_starts`; each position
    once, at most ``limit``."""
    matches = match_starts(history, ngram_max, limit)
    ordered = matches[:1] + resync_starts(history, ngram_max) + matches[1:]
    return list(dict.fromkeys(ordered))[:limit]


class NgramTrieDrafter:
    """Prompt lookup as a trie: the continuations (at most ``max_depth`` tokens) of the
    earlier matches of the recent suffix and of where a broken copy resumes
    (:func:`trie_starts`; the first ``4 * max_nodes`` of them) merged into one tree, nodes
    added in that order until ``max_nodes`` draft nodes. Its first path is the chain
    drafter's proposal, so greedy decoding accepts at least what the chain would; siblings
    are distinct tokens, earlier candidates first (the order ``sk.verify_tree`` tries
    deterministic candidates in)."""

    def __init__(self, ngram_max: int = 3, max_nodes: int = 16, max_depth: int = 8):
        if max_nodes < 1 or max_depth < 1:
            raise ValueError(f"trie_nodes / num_draft_tokens: expected >= 1, got "
                             f"{max_nodes} / {max_depth}")
        self.ngram_max, self.max_nodes, self.max_depth = ngram_max, max_nodes, max_depth

    def trie(self, history: Sequence[int]) -> tuple[list[int], list[int]]:
        """(tokens, parents) with the root (the last history token) as node 0."""
        tokens, parents = [int(history[-1]) if history else -1], [-1]
        children: list[dict] = [{}]
        # Each match adds at least one node or repeats a path: a few more than the budget.
        for start in trie_starts(history, self.ngram_max, 4 * self.max_nodes):
            node = 0
            for token in history[start:start + self.max_depth]:
                child = children[node].get(token)
                if child is None:
                    if len(tokens) > self.max_nodes:
                        return tokens, parents
                    child = len(tokens)
                    children[node][token] = child
                    children.append({})
                    tokens.append(int(token))
                    parents.append(node)
                node = child
            if len(tokens) > self.max_nodes:
                break
        return tokens, parents

    def plan(self, histories: Sequence[Sequence[int]], kv_lens) -> Optional[DraftPlan]:
        """One trie per request (``None``: no request has a match)."""
        tries = [self.trie(h) for h in histories]
        if all(len(t) == 1 for t, _ in tries):
            return None
        return deterministic_tree_plan(tries, kv_lens)


class ModelDrafter:
    """A draft model with its own :class:`SlotCache` (same positions as the target's: node
    ``i`` of a step at ``kv_lens[b] + i``). Committed tokens the draft has not seen yet (a
    fully accepted chain's last draft, and the pending token) are fed before drafting."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], capacity: int, device,
                 sampling, spec, seed: int = 0):
        self.model, self.sampling, self.spec = model, sampling, spec
        self.cache = SlotCache(len(prompts), capacity)
        self.draft_lens = prefill(model, self.cache, [list(p) for p in prompts], device)
        self.backlog: list[list[int]] = [[] for _ in prompts]
        # Sampled tree children (torch.multinomial); chains use sk.sample's Philox stream.
        self.generator = torch.Generator(device=device).manual_seed(seed + DRAFT_SEED)
        self._shapes: dict = {}

    def _shape(self, branching) -> TreeShape:
        key = tuple(branching)
        if key not in self._shapes:
            self._shapes[key] = TreeShape(key)
        return self._shapes[key]

    def _root_logits(self, kv_lens, pending) -> torch.Tensor:
        device = pending.device
        feeds = [self.backlog[b] + [int(t)] for b, t in enumerate(pending.tolist())]
        width = max(len(f) for f in feeds)
        tokens = torch.zeros(len(feeds), width, dtype=torch.long, device=device)
        for b, f in enumerate(feeds):
            tokens[b, :len(f)] = torch.tensor(f, dtype=torch.long)
        last = torch.tensor([len(f) - 1 for f in feeds], dtype=torch.long, device=device)
        if not torch.equal(self.draft_lens + last, kv_lens):
            raise RuntimeError("draft cache out of step with the target's")
        visible, depth = chain_visibility(len(feeds), width, device)
        return forward_block(self.model, self.cache, tokens, self.draft_lens, visible, depth,
                             rows=last[:, None])

    def skip(self, pending) -> None:
        """A step without drafts: the pending token is committed unseen by the draft."""
        for b, token in enumerate(pending.tolist()):
            self.backlog[b].append(token)

    def draft_chain(self, lengths, kv_lens, pending, seeds, offsets) -> Optional[DraftPlan]:
        k = max(lengths)
        if k == 0:
            return None
        plan = self.draft_tree((1,) * k, kv_lens, pending, seeds, offsets, chain=True)
        plan.num_draft = torch.tensor(lengths, dtype=torch.long, device=pending.device)
        return plan

    def draft_tree(self, branching, kv_lens, pending, seeds, offsets,
                   chain: bool = False) -> DraftPlan:
        shape = self._shape(branching)
        batch, device = pending.shape[0], pending.device
        params = self.sampling.kwargs()
        greedy = self.sampling.greedy
        children = "top_k" if chain else self.spec.children
        if greedy and children != "top_k":  # sampled children need a q with support > 1:
            params = dict(params, temperature=1.0)  # the draft's own law at temperature 1
        parents = shape.parents.to(device).expand(batch, -1)
        attention = sk.build_tree_attention(parents, prefix_lens=kv_lens)
        tokens = torch.full((batch, shape.num_nodes), -1, dtype=torch.long, device=device)
        logits = self._root_logits(kv_lens, pending)          # [B, 1, V] at the root
        vocab = logits.shape[-1]
        row_logits, row_probs = [], []
        depth_count = len(shape.branching)
        for d, width in enumerate(shape.branching, start=1):
            first, end = shape.levels[d]
            flat = logits.reshape(-1, vocab)                  # one row per parent node
            parent_nodes = torch.arange(*shape.levels[d - 1], device=device)
            if chain and greedy:  # sk.sample at temperature 0 is the arg-max (lowest id)
                picked = flat.argmax(-1, keepdim=True)
                row_logits.append(logits)
            elif chain:  # one child per node: a sample of q
                node = parent_nodes[None, :].expand(batch, -1).reshape(-1)
                picked = sk.sample(flat, seed=(seeds + DRAFT_SEED).repeat_interleave(
                    parent_nodes.numel()), offset=offsets.repeat_interleave(
                    parent_nodes.numel()) * NODE_OFFSETS + node, **params)[:, None]
                row_logits.append(logits)
            elif children == "top_k":
                picked = flat.topk(width, dim=-1).indices
            else:
                q = sk.processed_probs(flat, **params)
                picked = torch.multinomial(q, width, generator=self.generator,
                                           replacement=children == "iid")
                row_probs.append(q.reshape(batch, -1, vocab))
            tokens[:, first:end] = picked.reshape(batch, -1).to(torch.long)
            if d < depth_count:  # feed this level; its logits give the next level
                logits = forward_block(self.model, self.cache, tokens[:, first:end], kv_lens,
                                       attention.mask[:, first:end, :end],
                                       attention.depth[:, first:end].to(torch.long),
                                       write_offset=first)
        if chain:
            visible, depth = chain_visibility(batch, shape.num_nodes, device)
            plan = DraftPlan(tokens=tokens[:, 1:], visible=visible, depth=depth,
                             draft_logits=torch.cat(row_logits, 1))
        else:
            probs = None
            if row_probs:
                leaves = shape.num_nodes - sum(p.shape[1] for p in row_probs)
                probs = torch.cat(row_probs + [row_probs[0].new_zeros(batch, leaves, vocab)],
                                  1)
            plan = DraftPlan(tokens=tokens[:, 1:], visible=attention.mask,
                             depth=attention.depth.to(torch.long), parents=parents,
                             num_nodes=torch.full((batch,), shape.num_nodes, dtype=torch.long,
                                                  device=device),
                             draft_probs=probs,
                             draft_sampling="iid" if children != "without_replacement"
                             else "without_replacement")
        plan.tree_depth = depth_count
        return plan

    def commit(self, plan: DraftPlan, kv_lens, num_accepted, output_token_ids) -> None:
        """After verification: keep the fed accepted path, queue the rest for next step."""
        fed = plan.tree_depth - 1  # levels 1..depth-1 were fed to the draft
        kept = num_accepted.clamp(max=fed)
        if plan.is_tree:
            sk.compact_kv_cache(self.cache.tensors(), kv_lens, plan.accepted_nodes, kept,
                                layout="bhsd")
        self.draft_lens = kv_lens + 1 + kept
        out = output_token_ids.tolist()
        for b, (k, a) in enumerate(zip(kept.tolist(), num_accepted.tolist())):
            self.backlog[b] = out[b][k:a]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.draft_lens = self.draft_lens[rows]
        self.backlog = [self.backlog[r] for r in rows.tolist()]

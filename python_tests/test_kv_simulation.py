"""A toy decode loop with speculation, 2,000 steps per layout: every step writes the K/V of a
random draft tree at ``kv_lens + i``, accepts a random root-to-node path, compacts the cache
and checks every committed position against the cache a non-speculative loop would have
built: no position lost, moved twice or corrupted, nothing below ``kv_lens`` or of another
request touched. Requests restart when their cache is full (paged: with fresh blocks from a
shared pool), so lengths, block tables and tree shapes keep changing."""
import pytest
import torch

from specdec_kernels import _extension, compact_kv_cache, compact_paged_kv_cache

STEPS = 2000
BATCH, NODES, SEQ, HEADS, DIM, LAYERS, BLOCK = 4, 8, 48, 2, 4, 2, 4
VOCAB = 50


GARBAGE = -12345.0  # what padding nodes write: never a toy K/V value


def toy_kv(position, token, previous):
    """K/V of ``token`` at ``position`` after ``previous``, exact in float32: a position
    holding the wrong token, the wrong branch or the wrong depth reads differently."""
    return (position * 4096 + token * 64 + previous + 1).to(torch.float32)


# Added to toy_kv per (cache tensor, head): a mixed-up layer, K/V or head shows.
OFFSETS = [(torch.arange(HEADS, dtype=torch.float32) * 0.5 + i * 0.125)[:, None].expand(HEADS, DIM)
           for i in range(2 * LAYERS)]


def random_trees(steps, gen):
    """Every step's trees at once (one loop over node indices for the whole run): ragged
    sizes, node i's parent uniform in [0, i), depth, ancestor sets, tokens, accepted node."""
    nodes = torch.arange(NODES)
    real = torch.randint(1, NODES + 1, (steps, BATCH), generator=gen)
    parents = (torch.rand(steps, BATCH, NODES, generator=gen) * nodes).long()
    parents[..., 0] = 0
    depth = torch.zeros(steps, BATCH, NODES, dtype=torch.int64)
    ancestors = torch.eye(NODES, dtype=torch.bool).repeat(steps, BATCH, 1, 1)
    for i in range(1, NODES):
        parent = parents[..., i:i + 1]
        depth[..., i] = depth.gather(-1, parent)[..., 0] + 1
        ancestors[..., i, :] |= ancestors.gather(
            2, parent[..., None].expand(steps, BATCH, 1, NODES))[..., 0, :]
    tokens = torch.randint(0, VOCAB, (steps, BATCH, NODES), generator=gen)  # [.., 0]: the root
    end = (torch.rand(steps, BATCH, generator=gen) * real).long()          # the accepted node
    return real, parents, depth, ancestors, tokens, end


class Loop:
    def __init__(self, layout, backend, seed, steps):
        self.layout, self.backend = layout, backend
        self.gen = torch.Generator().manual_seed(seed)
        if layout == "paged":
            self.blocks_per_request = SEQ // BLOCK
            num_blocks = BATCH * self.blocks_per_request + 5
            shape = (num_blocks, BLOCK, HEADS, DIM)
            order = torch.randperm(num_blocks, generator=self.gen)
            self.tables = order[:BATCH * self.blocks_per_request].view(BATCH, -1).clone()
            self.free = order[BATCH * self.blocks_per_request:]
        else:
            shape = (BATCH, SEQ, HEADS, DIM) if layout == "bshd" else (BATCH, HEADS, SEQ, DIM)
        self.caches = [torch.randn(shape, generator=self.gen) for _ in range(2 * LAYERS)]
        # What a decode loop without speculation would hold: [B, S, H, D] per cache tensor.
        self.expected = [torch.zeros(BATCH, SEQ, HEADS, DIM) for _ in self.caches]
        self.kv_lens = torch.zeros(BATCH, dtype=torch.int64)
        self.last_token = torch.full((BATCH,), -1)  # the last committed token (-1: none)
        self.trees = random_trees(steps, self.gen)
        self.step_index = 0
        self.rows = torch.arange(BATCH)[:, None]
        self.nodes = torch.arange(NODES)

    def logical(self, cache):
        """A cache as ``[B, S, H, D]`` (a gather through the block tables when paged)."""
        if self.layout == "paged":
            return cache[self.tables].flatten(1, 2)
        return cache if self.layout == "bshd" else cache.transpose(1, 2)

    def write(self, positions, value):
        """``value`` ``[B, N]`` (plus each tensor's offsets) at ``positions`` ``[B, N]``."""
        if self.layout == "paged":
            index = (self.tables.gather(1, positions // BLOCK), positions % BLOCK)
        else:
            index = (self.rows, positions)
        for cache, offset in zip(self.caches, OFFSETS):
            view = cache.transpose(1, 2) if self.layout == "bhsd" else cache
            view[index] = value[..., None, None] + offset

    def restart_full_requests(self):
        for b in (self.kv_lens + NODES > SEQ).nonzero()[:, 0].tolist():
            self.kv_lens[b] = 0
            self.last_token[b] = -1
            if self.layout == "paged":  # old blocks back to the pool, random ones out of it
                pool = torch.cat([self.free, self.tables[b]])
                pool = pool[torch.randperm(len(pool), generator=self.gen)]
                self.tables[b] = pool[:self.blocks_per_request]
                self.free = pool[self.blocks_per_request:]

    def step(self):
        self.restart_full_requests()
        real, parents, depth, ancestors, tokens, end = (t[self.step_index] for t in self.trees)
        self.step_index += 1
        nodes, start = self.nodes, self.kv_lens[:, None]
        previous = tokens.gather(1, parents)
        previous[:, 0] = self.last_token
        # The verify forward: node i's K/V at kv_lens + i; padding nodes write garbage.
        value = torch.where(nodes < real[:, None], toy_kv(start + depth, tokens, previous), GARBAGE)
        self.write(start + nodes, value)
        # Accept the path to a random real node: its ancestors in increasing index order.
        on_path = ancestors[torch.arange(BATCH), end]
        order = torch.where(on_path, nodes, NODES + nodes).argsort(1)
        num_accepted = on_path.sum(1) - 1
        commit = nodes <= num_accepted[:, None]
        accepted = torch.where(commit, order, -1).to(torch.int32)
        # The non-speculative cache: the path's tokens, one after another, at kv_lens + k.
        path_tokens = tokens.gather(1, order)
        path_previous = torch.cat([self.last_token[:, None], path_tokens[:, :-1]], 1)
        positions = (start + nodes)[commit]
        committed = toy_kv(positions, path_tokens[commit], path_previous[commit])
        requests = self.rows.expand(BATCH, NODES)[commit]
        for expected, offset in zip(self.expected, OFFSETS):
            expected[requests, positions] = committed[:, None, None] + offset
        if self.layout == "paged":
            new = compact_paged_kv_cache(self.caches, self.tables, self.kv_lens, accepted,
                                         num_accepted.to(torch.int32), backend=self.backend)
        else:
            new = compact_kv_cache(self.caches, self.kv_lens, accepted,
                                   num_accepted.to(torch.int32), layout=self.layout,
                                   backend=self.backend)
        assert torch.equal(new, self.kv_lens + num_accepted + 1)
        self.kv_lens = new
        self.last_token = path_tokens.gather(1, num_accepted[:, None])[:, 0]
        return int(num_accepted.sum())

    def check(self):
        """Every committed position equals what the non-speculative loop wrote there."""
        committed = torch.arange(SEQ)[None, :] < self.kv_lens[:, None]
        for i, (cache, expected) in enumerate(zip(self.caches, self.expected)):
            got = self.logical(cache)
            if not torch.equal(got[committed], expected[committed]):
                bad = ((got != expected).flatten(2).any(2) & committed).nonzero().tolist()
                raise AssertionError(f"cache {i}: (request, position) {bad[:5]} corrupted")


BACKENDS = ["auto", "reference"] if _extension.HAS_EXTENSION else ["reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "paged"])
def test_decode_loop_matches_non_speculative_cache(layout, backend):
    steps = STEPS if backend == "auto" else STEPS // 10  # "auto" is the extension under test
    loop = Loop(layout, backend, seed=len(layout) + len(backend), steps=steps)
    accepted_drafts = 0
    for _ in range(steps):
        accepted_drafts += loop.step()
        loop.check()
    assert accepted_drafts > steps  # the loop did speculate (about 1.5 drafts per request-step)

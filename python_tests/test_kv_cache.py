"""compact_kv_cache / compact_paged_kv_cache (contract section 6): the reference against
hand-computed moves and a one-request-at-a-time definition, the compiled extension (CPU, and
CUDA when present) against the reference, bad input (ValueError, no byte written), opcheck
and torch.compile."""
import re

import pytest
import torch

import specdec_kernels
from specdec_kernels import _backend, compact_kv_cache, compact_paged_kv_cache
from specdec_kernels.reference import kv_cache as reference
from conftest import EXTENSION_BACKENDS, needs_cuda, needs_extension

BACKENDS = EXTENSION_BACKENDS
SIZES = [1, 7, 32, 33, 64, 100]
LAYOUTS = ["bshd", "bhsd", "paged"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# Helpers: random inputs and the definition
# ---------------------------------------------------------------------------------------------


def random_path(gen, n):
    """Root-first path to a random node of a random tree of n nodes."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    node, path = int(torch.randint(0, n, (1,), generator=gen)), []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_paths(batch, n, gen, index_dtype=torch.int32):
    accepted = torch.full((batch, n), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        path = random_path(gen, n)
        if b == 1:
            path = list(range(len(path)))  # a chain: moves nothing
        accepted[b, :len(path)] = torch.tensor(path)
        num_accepted[b] = len(path) - 1
    return accepted.to(index_dtype), num_accepted.to(index_dtype)


def random_bytes(shape, dtype, gen):
    """Any bit pattern (fp8 NaNs included): compaction moves bytes, tests compare bytes."""
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


class Problem:
    """A batch of caches, lengths and accepted paths in one layout."""

    def __init__(self, layout, *, batch=5, n=7, layers=2, heads=2, dim=8, dtype=torch.float16,
                 block_size=4, seed=0, index_dtype=torch.int32, extra=3):
        gen = torch.Generator().manual_seed(seed)
        self.layout, self.n = layout, n
        self.accepted, self.num_accepted = random_paths(batch, n, gen, index_dtype)
        seq = n + extra + 6
        self.kv_lens = torch.randint(0, seq - n + 1, (batch,), generator=gen).to(index_dtype)
        if layout == "paged":
            max_blocks = -(-seq // block_size)
            num_blocks = batch * max_blocks + 3
            pool = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks]
            self.block_tables = pool.view(batch, max_blocks).to(index_dtype)
            # Columns past a request's path are unused: any value, even outside the pool.
            last = (self.kv_lens.long() + n - 1) // block_size
            unused = torch.arange(max_blocks)[None, :] > last[:, None]
            self.block_tables[unused] = -1
            shape = (num_blocks, block_size, heads, dim)
        else:
            self.block_tables = None
            shape = (batch, seq, heads, dim) if layout == "bshd" else (batch, heads, seq, dim)
        self.caches = [random_bytes(shape, dtype, gen) for _ in range(2 * layers)]

    def clone_caches(self):
        return [c.clone() for c in self.caches]

    def run(self, caches, *, backend, validate=True, kv_lens=None, accepted=None, num=None,
            block_tables=None):
        kv_lens = self.kv_lens if kv_lens is None else kv_lens
        accepted = self.accepted if accepted is None else accepted
        num = self.num_accepted if num is None else num
        if self.layout == "paged":
            tables = self.block_tables if block_tables is None else block_tables
            return compact_paged_kv_cache(caches, tables, kv_lens, accepted, num,
                                          backend=backend, validate=validate)
        return compact_kv_cache(caches, kv_lens, accepted, num, layout=self.layout,
                                backend=backend, validate=validate)

    def position(self, cache, b, t):
        """View of position t of request b (the definition's addressing)."""
        if self.layout == "bshd":
            return cache[b, t]
        if self.layout == "bhsd":
            return cache[b, :, t]
        block = int(self.block_tables[b, t // cache.shape[1]])
        return cache[block, t % cache.shape[1]]

    def expected(self):
        """The definition, one request at a time: copy every source of the path, then write."""
        caches = self.clone_caches()
        for cache in caches:
            for b in range(self.accepted.shape[0]):
                start, count = int(self.kv_lens[b]), int(self.num_accepted[b])
                path = self.accepted[b, :count + 1].tolist()
                staged = [self.position(cache, b, start + node).clone() for node in path]
                for k, value in enumerate(staged):
                    self.position(cache, b, start + k).copy_(value)
        return caches


def assert_caches_equal(got, expected):
    for i, (g, e) in enumerate(zip(got, expected)):
        got_bytes, expected_bytes = as_bytes(g.cpu()), as_bytes(e.cpu())
        if not torch.equal(got_bytes, expected_bytes):
            differ = int((got_bytes != expected_bytes).sum())
            raise AssertionError(f"caches[{i}] differs in {differ} bytes")


# ---------------------------------------------------------------------------------------------
# Hand-computed moves
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_overlap_by_hand(backend, layout):
    # kv_len 2, path [0, 2, 3]: node 2 moves to offset 1 while node 3 moves onto node 2's old
    # place. Position t holds t (and 100 + t in head 1); request 1 (a chain) must not change.
    seq = 8
    values = torch.arange(seq, dtype=torch.float32)
    heads = torch.stack([values, 100 + values])                      # [H, S]
    cache = (heads.T if layout == "bshd" else heads)[None, ..., None].repeat(2, 1, 1, 1)
    new = compact_kv_cache([cache], torch.tensor([2, 1]),
                           torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]]),
                           torch.tensor([2, 1]), layout=layout, backend=backend)
    assert new.tolist() == [5, 3]
    first = cache[0, :, 0, 0] if layout == "bshd" else cache[0, 0, :, 0]
    second_head = cache[0, :, 1, 0] if layout == "bshd" else cache[0, 1, :, 0]
    assert first.tolist() == [0, 1, 2, 4, 5, 5, 6, 7]
    assert second_head.tolist() == [100, 101, 102, 104, 105, 105, 106, 107]
    other = cache[1, :, 0, 0] if layout == "bshd" else cache[1, 0, :, 0]
    assert other.tolist() == list(range(8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_by_hand(backend):
    # Blocks of 2 slots; request 0 owns blocks [3, 1, 0], request 1 owns [2, 4]; position t
    # of request b holds 10 * b + t. Request 0: kv_len 1, path [0, 1, 3, 4]: node 3 (position
    # 4, block 1) moves to position 3 (block 1) and node 4 (position 5, block 0) to position 4.
    # Request 1: kv_len 0, path [0, 2]: position 2 (block 4) moves to position 1 (block 2).
    cache = torch.zeros(5, 2, 1)
    tables = torch.tensor([[3, 1, 0], [2, 4, -1]])
    for b, row in enumerate(tables.tolist()):
        for t in range(6 if b == 0 else 4):
            cache[row[t // 2], t % 2, 0] = 10 * b + t
    new = compact_paged_kv_cache([cache], tables, torch.tensor([1, 0]),
                                 torch.tensor([[0, 1, 3, 4, -1], [0, 2, -1, -1, -1]]),
                                 torch.tensor([3, 1]), backend=backend)
    assert new.tolist() == [5, 2]
    positions = lambda b, n: [cache[tables[b, t // 2], t % 2, 0].item() for t in range(n)]
    assert positions(0, 6) == [0, 1, 2, 4, 5, 5]
    assert positions(1, 4) == [10, 12, 12, 13]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chain_moves_nothing(backend, layout):
    problem = Problem(layout, batch=4, n=9, seed=1)
    problem.accepted = torch.where(torch.arange(9)[None, :] <= problem.num_accepted[:, None].long(),
                                   torch.arange(9)[None, :], -1).to(torch.int32)
    caches = problem.clone_caches()
    new = problem.run(caches, backend=backend)
    assert_caches_equal(caches, problem.caches)
    assert new.tolist() == (problem.kv_lens + problem.num_accepted + 1).tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 7, 33])
def test_reference_matches_definition(layout, n):
    problem = Problem(layout, batch=6, n=n, seed=n, dtype=torch.float32)
    caches = problem.clone_caches()
    problem.run(caches, backend="reference")
    assert_caches_equal(caches, problem.expected())


# ---------------------------------------------------------------------------------------------
# The extension against the reference (and the definition)
# ---------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extension_matches_reference(layout, n, dtype):
    layers = 1 + n % 3
    index_dtype = torch.int64 if n % 2 else torch.int32
    problem = Problem(layout, batch=7, n=n, layers=layers, dtype=dtype, seed=10 * n + len(layout),
                      index_dtype=index_dtype, block_size=5 if n % 2 else 16)
    got, expected = problem.clone_caches(), problem.clone_caches()
    new = problem.run(got, backend="extension")
    new_reference = problem.run(expected, backend="reference")
    assert_caches_equal(got, expected)
    assert new.dtype == problem.kv_lens.dtype and torch.equal(new, new_reference)
    if n <= 33:
        assert_caches_equal(got, problem.expected())


@needs_extension
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_extension_strided_caches(layout):
    # K and V as halves of one [2, B, S, H, D'] buffer with D' > D: not contiguous, rows of a
    # contiguous last dimension (the extension moves per-head rows).
    gen = torch.Generator().manual_seed(4)
    batch, n, seq = 5, 12, 30
    shape = (2, batch, seq, 3, 10) if layout == "bshd" else (2, batch, 3, seq, 10)
    buffer = random_bytes(shape, torch.bfloat16, gen)
    accepted, num = random_paths(batch, n, gen)
    kv_lens = torch.randint(0, seq - n, (batch,), generator=gen)
    expected = [c.clone() for c in buffer[..., :8]]
    reference.compact_kv_cache(expected, kv_lens, accepted, num, layout=layout)
    before = buffer[..., 8:].clone()
    compact_kv_cache(list(buffer[..., :8]), kv_lens, accepted, num, layout=layout,
                     backend="extension")
    assert_caches_equal(list(buffer[..., :8]), expected)
    assert torch.equal(as_bytes(buffer[..., 8:]), as_bytes(before))  # bytes outside untouched


@needs_extension
def test_extension_size_one_head_dim_with_any_stride():
    """A last dimension of size 1 is contiguous whatever its stride (every ``[..., ::4]`` view of
    a ``D = 4`` cache): the extension compacts it like the reference, contiguous and paged."""
    gen = torch.Generator().manual_seed(6)
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, 3, -1]])
    num, kv_lens = torch.tensor([2, 2]), torch.tensor([1, 3])
    buffer = random_bytes((2, 9, 2, 4), torch.float32, gen)
    expected = buffer[..., ::4].clone()
    reference.compact_kv_cache([expected], kv_lens, accepted, num)
    compact_kv_cache([buffer[..., ::4]], kv_lens, accepted, num, backend="extension")
    assert_caches_equal([buffer[..., ::4]], [expected])
    pool = random_bytes((6, 3, 2, 4), torch.float32, gen)
    tables = torch.tensor([[4, 0, 2], [5, 1, 3]])
    expected = pool[..., ::4].clone()
    reference.compact_paged_kv_cache([expected], tables, kv_lens, accepted, num)
    compact_paged_kv_cache([pool[..., ::4]], tables, kv_lens, accepted, num, backend="extension")
    assert_caches_equal([pool[..., ::4]], [expected])


@needs_extension
def test_extension_many_layers_and_threads():
    # 64 layer tensors and B = 48: at::parallel_for splits the (request, layer) items.
    problem = Problem("bshd", batch=48, n=16, layers=32, heads=4, dim=16, dtype=torch.bfloat16,
                      seed=8)
    got, expected = problem.clone_caches(), problem.clone_caches()
    problem.run(got, backend="extension")
    problem.run(expected, backend="reference")
    assert_caches_equal(got, expected)


@needs_extension
def test_auto_uses_extension_on_cpu():
    for op in ("compact_kv_cache", "compact_paged_kv_cache"):
        assert _backend.use_extension(op, "auto", torch.device("cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_tensor_and_new_lengths_dtype(backend):
    cache = torch.arange(10.0).view(1, 10, 1, 1)
    for dtype in (torch.int32, torch.int64):
        new = compact_kv_cache(cache, torch.tensor([3], dtype=dtype),
                               torch.tensor([[0, 1, 3, -1]], dtype=torch.int32),
                               torch.tensor([2], dtype=torch.int64), backend=backend)
        assert new.dtype == dtype and new.tolist() == [6]
    assert cache.flatten().tolist() == [0, 1, 2, 3, 4, 6, 6, 7, 8, 9]  # 6 moved to 5, twice


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unvalidated_bad_entries_are_skipped_alike(backend, layout):
    # validate=False: out-of-cache sources, nodes >= N, negative kv_lens, blocks outside the
    # pool are skipped and num_accepted past N - 1 clamped, the same way by every backend.
    problem = Problem(layout, batch=4, n=6, seed=12, dtype=torch.float32, extra=0)
    accepted = torch.tensor([[0, 2, 9, -1, -1, -1],      # node 9 >= N
                             [0, 1, 3, 4, -1, -1],       # negative kv_lens
                             [0, 2, 3, 4, 5, -1],        # num_accepted 9, clamped to 5
                             [0, 1, 2, 5, -1, -1]])      # reads past the cache
    kv_lens = torch.tensor([2, -3, 0, 100])
    num = torch.tensor([2, 3, 9, 3])
    if layout == "paged":
        problem.block_tables[0, 0] = 10**6               # a block outside the pool
    got, expected = problem.clone_caches(), problem.clone_caches()
    new = problem.run(got, backend=backend, validate=False, kv_lens=kv_lens, accepted=accepted,
                      num=num)
    reference_new = problem.run(expected, backend="reference", validate=False, kv_lens=kv_lens,
                                accepted=accepted, num=num)
    assert_caches_equal(got, expected)
    assert new.tolist() == reference_new.tolist() == [5, 1, 6, 104]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_unvalidated_unordered_path_stays_in_its_request(backend, layout):
    # A path that is not increasing (validate=False) leaves the request's own positions
    # >= kv_len unspecified, but never touches positions below kv_len or other requests.
    problem = Problem(layout, batch=3, n=6, seed=13, dtype=torch.float32)
    accepted = problem.accepted.clone()
    accepted[1] = torch.tensor([0, 5, 5, 1, 3, 2])
    num = problem.num_accepted.clone()
    num[1] = 5
    kv_lens = problem.kv_lens.clone()
    kv_lens[1] = 2
    got, expected = problem.clone_caches(), problem.clone_caches()
    problem.run(got, backend=backend, validate=False, accepted=accepted, num=num, kv_lens=kv_lens)
    problem.run(expected, backend="reference", accepted=accepted[[0, 2]][[0, 0, 1]],
                num=num[[0, 0, 2]], kv_lens=kv_lens[[0, 0, 2]], validate=False)
    for g, e, before in zip(got, expected, problem.caches):
        for b in (0, 2):
            assert torch.equal(as_bytes(g[b]), as_bytes(e[b]))
        seq_axis = 0 if layout == "bshd" else 1
        assert torch.equal(as_bytes(g[1].narrow(seq_axis, 0, 2)),
                           as_bytes(before[1].narrow(seq_axis, 0, 2)))


# ---------------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument, and not one byte written
# ---------------------------------------------------------------------------------------------


def _bad(problem, what):
    """Arguments for run() that break one rule; the path of request 0 is [0, 2, 3]."""
    accepted, num = problem.accepted.clone(), problem.num_accepted.clone()
    kv_lens = problem.kv_lens.clone()
    tables = None if problem.block_tables is None else problem.block_tables.clone()
    accepted[0, :4] = torch.tensor([0, 2, 3, -1])
    num[0] = 2
    kv_lens[0] = 1
    if what == "not_increasing":
        accepted[0, :3] = torch.tensor([0, 3, 2])
    elif what == "repeated":
        accepted[0, :3] = torch.tensor([0, 2, 2])
    elif what == "root":
        accepted[0, 0] = 1
    elif what == "num_negative":
        num[0] = -1
    elif what == "num_too_large":
        num[0] = problem.n
    elif what == "kv_lens_negative":
        kv_lens[0] = -1
    elif what == "node_past_tree":
        accepted[0, 2] = problem.n
    elif what == "past_cache":
        kv_lens[0] = problem.caches[0].shape[1 if problem.layout == "bshd" else 2] - 3
        if problem.layout == "paged":
            kv_lens[0] = tables.shape[1] * problem.caches[0].shape[1] - 3
    elif what == "new_length_past_cache":  # a chain whose new length is S + 1
        accepted[0, :4] = torch.arange(4)
        num[0] = 3
        kv_lens[0] = problem.caches[0].shape[1 if problem.layout == "bshd" else 2] - 3
        if problem.layout == "paged":
            kv_lens[0] = tables.shape[1] * problem.caches[0].shape[1] - 3
    elif what == "block_outside_pool":
        tables[0, 0] = problem.caches[0].shape[0]
    elif what == "block_negative":
        tables[0, 0] = -1
    return dict(kv_lens=kv_lens, accepted=accepted, num=num, block_tables=tables)


BAD_VALUES = [
    ("not_increasing", "accepted_nodes", "strictly after its predecessor"),
    ("repeated", "accepted_nodes", "strictly after its predecessor"),
    ("root", "accepted_nodes", "start at the root"),
    ("num_negative", "num_accepted", "got -1"),
    ("num_too_large", "num_accepted", "got 7"),
    ("kv_lens_negative", "kv_lens", "got -1"),
    ("node_past_tree", "accepted_nodes", "node indices < 7"),
    ("past_cache", "accepted_nodes", "past"),
    ("new_length_past_cache", "accepted_nodes", "past"),
]


BAD_BLOCKS = [("block_outside_pool", "block_tables", "[0, "),
              ("block_negative", "block_tables", "= -1")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout, what, argument, needle",
                         [(layout, *bad) for layout in LAYOUTS for bad in BAD_VALUES]
                         + [("paged", *bad) for bad in BAD_BLOCKS])
def test_bad_values_raise_and_write_nothing(backend, layout, what, argument, needle):
    problem = Problem(layout, batch=3, n=7, seed=21)
    caches = problem.clone_caches()
    with pytest.raises(ValueError, match=rf"^{argument}: ") as err:
        problem.run(caches, backend=backend, **_bad(problem, what))
    assert needle in str(err.value), str(err.value)
    assert_caches_equal(caches, problem.caches)
    if layout == "paged" and what in ("past_cache", "new_length_past_cache"):
        assert "block table" in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_structure_raises_value_error(backend):
    problem = Problem("bshd", batch=3, n=7, seed=2)
    caches = problem.clone_caches()
    args = (problem.kv_lens, problem.accepted, problem.num_accepted)
    cases = [
        (caches[:1] + [caches[1][:, :-1]], "caches[1]", "shape"),
        (caches[:1] + [caches[1].float()], "caches[1]", "dtype"),
        (caches[:1] + [caches[1].transpose(1, 2).contiguous().transpose(1, 2)], "caches[1]",
         "strides"),
        ([c[:2] for c in caches], "caches", "3 requests"),
        ([c.to(torch.int16) for c in caches], "caches", "floating-point"),
        ([c[0] for c in caches], "caches", "4-D"),
        ([c[..., ::2] for c in caches], "caches", "contiguous last dimension"),
        (caches + [caches[1]], f"caches[{len(caches)}]", r"distinct tensors.*caches\[1\]"),
        (caches[:1] + [caches[0].view_as(caches[0])], "caches[1]", "distinct tensors"),
    ]
    for bad_caches, argument, needle in cases:
        with pytest.raises(ValueError, match=rf"^{re.escape(argument)}: .*{needle}"):
            compact_kv_cache(bad_caches, *args, backend=backend)
    with pytest.raises(ValueError, match=r"^kv_lens: expected shape \[3\]"):
        compact_kv_cache(caches, problem.kv_lens[:2], *args[1:], backend=backend)
    with pytest.raises(ValueError, match=r"^num_accepted: expected shape \[3\]"):
        compact_kv_cache(caches, *args[:2], problem.num_accepted[:1], backend=backend)
    with pytest.raises(ValueError, match=r"^layout: "):
        compact_kv_cache(caches, *args, layout="bsd", backend=backend)
    with pytest.raises(ValueError, match=r"^block_tables: expected 3 rows"):
        compact_paged_kv_cache(caches, torch.zeros(2, 4, dtype=torch.int32), *args,
                               backend=backend)
    with pytest.raises(TypeError, match=r"^caches: "):
        compact_kv_cache([], *args, backend=backend)
    with pytest.raises(TypeError, match=r"^caches\[1\]: "):
        compact_kv_cache([caches[0], "v"], *args, backend=backend)
    with pytest.raises(TypeError, match=r"^accepted_nodes: "):
        compact_kv_cache(caches, args[0], args[1].float(), args[2], backend=backend)
    assert_caches_equal(caches, problem.caches)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_batch(backend, layout):
    problem = Problem(layout, batch=0, n=3)
    assert problem.run(problem.clone_caches(), backend=backend).shape == (0,)


def test_unknown_backend():
    problem = Problem("bshd", batch=2, n=3)
    with pytest.raises(ValueError, match="^backend: "):
        problem.run(problem.clone_caches(), backend="triton")


# ---------------------------------------------------------------------------------------------
# Custom-op plumbing
# ---------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(layout):
    problem = Problem(layout, batch=4, n=6, layers=2, dtype=torch.float32, seed=5)
    if layout == "paged":
        op = torch.ops.specdec.compact_paged_kv_cache.default
        args = (problem.caches, problem.block_tables.clamp(min=0), problem.kv_lens,
                problem.accepted, problem.num_accepted)
    else:
        op = torch.ops.specdec.compact_kv_cache.default
        args = (problem.caches, problem.kv_lens, problem.accepted, problem.num_accepted, layout)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "paged"])
def test_torch_compile_fullgraph(backend, layout):
    torch._dynamo.reset()
    problem = Problem(layout, batch=4, n=6, layers=2, dtype=torch.float32, seed=6)

    @torch.compile(fullgraph=True)
    def rollback(caches, tables, kv_lens, accepted, num):
        if tables is None:
            return specdec_kernels.compact_kv_cache(caches, kv_lens, accepted, num,
                                                    backend=backend, validate=False)
        return specdec_kernels.compact_paged_kv_cache(caches, tables, kv_lens, accepted, num,
                                                      backend=backend, validate=False)

    caches = problem.clone_caches()
    new = rollback(caches, problem.block_tables, problem.kv_lens, problem.accepted,
                   problem.num_accepted)
    assert new.tolist() == (problem.kv_lens + problem.num_accepted + 1).tolist()
    assert_caches_equal(caches, problem.expected())


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@needs_cuda
@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_extension_matches_reference(layout, n, dtype):
    problem = Problem(layout, batch=7, n=n, layers=1 + n % 3, dtype=dtype, seed=n,
                      index_dtype=torch.int64 if n % 2 else torch.int32)
    expected = problem.clone_caches()
    reference_new = problem.run(expected, backend="reference")
    gpu = [c.cuda() for c in problem.caches]
    args = dict(kv_lens=problem.kv_lens.cuda(), accepted=problem.accepted.cuda(),
                num=problem.num_accepted.cuda())
    if layout == "paged":
        args["block_tables"] = problem.block_tables.cuda()
    new = problem.run(gpu, backend="auto", **args)
    assert new.is_cuda and torch.equal(new.cpu(), reference_new)
    assert_caches_equal(gpu, expected)


@needs_cuda
@needs_extension
@pytest.mark.parametrize("dim, offset", [(8, 0), (5, 0), (8, 1), (3, 1)])
def test_cuda_narrow_vectors(dim, offset):
    # Odd head sizes and a base pointer off 16-byte alignment force 8/4/2-byte vectors.
    gen = torch.Generator().manual_seed(dim + offset)
    batch, n, seq = 4, 9, 20
    flat = random_bytes((batch * seq * 3 * dim + offset,), torch.float16, gen)
    cache = flat[offset:].view(batch, seq, 3, dim)
    accepted, num = random_paths(batch, n, gen)
    kv_lens = torch.randint(0, seq - n, (batch,), generator=gen)
    expected = [cache.clone()]
    reference.compact_kv_cache(expected, kv_lens, accepted, num)
    gpu_flat = flat.cuda()
    gpu = gpu_flat[offset:].view(batch, seq, 3, dim)
    compact_kv_cache([gpu], kv_lens.cuda(), accepted.cuda(), num.cuda(), backend="extension")
    assert_caches_equal([gpu], expected)


@needs_cuda
@needs_extension
def test_cuda_more_than_256_layer_tensors():
    problem = Problem("bshd", batch=3, n=8, layers=150, heads=1, dim=8, dtype=torch.float16)
    expected = problem.clone_caches()
    problem.run(expected, backend="reference")
    gpu = [c.cuda() for c in problem.caches]
    new = compact_kv_cache(gpu, problem.kv_lens.cuda(), problem.accepted.cuda(),
                           problem.num_accepted.cuda())
    assert torch.equal(new.cpu(), problem.kv_lens + problem.num_accepted + 1)
    assert_caches_equal(gpu, expected)


@needs_cuda
@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_capture(layout):
    # validate=False: no synchronisation, no host-side work that a graph would skip.
    problem = Problem(layout, batch=5, n=9, layers=3, dtype=torch.bfloat16, seed=31)
    expected = problem.clone_caches()
    problem.run(expected, backend="reference")
    gpu = [c.cuda() for c in problem.caches]
    args = dict(kv_lens=problem.kv_lens.cuda(), accepted=problem.accepted.cuda(),
                num=problem.num_accepted.cuda())
    if layout == "paged":
        args["block_tables"] = problem.block_tables.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new = problem.run(gpu, backend="extension", validate=False, **args)
    assert_caches_equal(gpu, problem.caches)  # capture records, it does not run
    graph.replay()
    torch.cuda.synchronize()
    assert_caches_equal(gpu, expected)
    assert torch.equal(new.cpu(), problem.kv_lens + problem.num_accepted + 1)

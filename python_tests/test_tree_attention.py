"""build_tree_attention (contract section 5): the reference against hand-computed trees and an
ancestor walk, the compiled extension (CPU, and CUDA when present) against the reference, bad
input, opcheck and torch.compile."""
import pytest
import torch

import specdec_kernels
from specdec_kernels import TreeAttention, build_tree_attention
from specdec_kernels import _backend
from specdec_kernels.reference import tree_attention as reference
from conftest import EXTENSION_BACKENDS, needs_cuda, needs_extension

BACKENDS = EXTENSION_BACKENDS
SIZES = [1, 7, 32, 33, 64, 100]


def random_trees(batch, n, *, seed, index_dtype=torch.int64, ragged=True):
    """Random parents (some chains, some stars), ragged num_nodes, padding parents garbage."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    if batch > 1 and n > 1:
        parents[1, 1:] = torch.arange(n - 1)  # a chain
    if batch > 2 and n > 1:
        parents[2, 1:] = 0                    # a star
    num_nodes = (torch.randint(1, n + 1, (batch,), generator=gen) if ragged
                 else torch.full((batch,), n))
    num_nodes[0] = n
    padding = torch.arange(n)[None, :] >= num_nodes[:, None]
    parents[padding] = torch.randint(-3, n + 3, (int(padding.sum()),), generator=gen)
    prefix_lens = torch.randint(0, 5000, (batch,), generator=gen)
    return parents.to(index_dtype), num_nodes.to(index_dtype), prefix_lens


def walk(parents, num_nodes, prefix_lens):
    """The definition, one node at a time: follow parents to the root."""
    batch, n = parents.shape
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    depth = torch.zeros(batch, n, dtype=torch.int32)
    for b in range(batch):
        for i in range(n):
            mask[b, i, i] = True
            if i >= num_nodes[b]:
                continue
            j = i
            while j != 0:
                j = int(parents[b, j])
                mask[b, i, j] = True
                depth[b, i] += 1
    packed = torch.zeros(batch, n, (n + 31) // 32, dtype=torch.int64)
    for j in range(n):
        packed[:, :, j // 32] |= mask[:, :, j].to(torch.int64) << (j % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return TreeAttention(mask, packed, depth, prefix_lens[:, None] + depth.to(torch.int64))


def assert_same(got: TreeAttention, expected: TreeAttention):
    for name, g, e in zip(TreeAttention._fields, got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, e.dtype, g.shape, e.shape)
        if not torch.equal(g.cpu(), e.cpu()):
            bad = (g.cpu() != e.cpu()).nonzero()[:5].tolist()
            raise AssertionError(f"{name} differs at {bad}")


# ---------------------------------------------------------------------------------------------
# Hand-computed trees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_tree_with_padding(backend):
    # 0 -> {1, 2}, 1 -> 3, 3 -> 4; node 5 is padding (its parent entry is ignored).
    parents = torch.tensor([[-1, 0, 0, 1, 3, 99]], dtype=torch.int32)
    out = build_tree_attention(parents, num_nodes=5, prefix_lens=torch.tensor([10]),
                               backend=backend)
    assert out.mask.int().tolist() == [[[1, 0, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0, 0],
                                        [1, 0, 1, 0, 0, 0],
                                        [1, 1, 0, 1, 0, 0],
                                        [1, 1, 0, 1, 1, 0],
                                        [0, 0, 0, 0, 0, 1]]]
    assert out.packed_mask.tolist() == [[[0b1], [0b11], [0b101], [0b1011], [0b11011], [0b100000]]]
    assert out.depth.tolist() == [[0, 1, 1, 2, 3, 0]]
    assert out.position_ids.tolist() == [[10, 11, 11, 12, 13, 10]]
    assert (out.mask.dtype, out.packed_mask.dtype, out.depth.dtype, out.position_ids.dtype) == (
        torch.bool, torch.int32, torch.int32, torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_words_and_sign_bit(backend):
    # A chain of 33 nodes: node 32 sees all 33 nodes: word 0 is all ones (int32 -1), word 1 is 1.
    parents = (torch.arange(33) - 1)[None, :]
    out = build_tree_attention(parents, backend=backend)
    assert out.packed_mask.shape == (1, 33, 2)
    assert out.packed_mask[0, 32].tolist() == [-1, 1]
    assert out.packed_mask[0, 31].tolist() == [-1, 0]
    assert out.packed_mask[0, 30].tolist() == [2**31 - 1, 0]
    assert out.depth[0].tolist() == list(range(33))
    assert out.position_ids[0].tolist() == list(range(33))  # prefix_lens defaults to 0


@pytest.mark.parametrize("n", SIZES)
def test_reference_matches_walk(n):
    parents, num_nodes, prefix_lens = random_trees(4, n, seed=n)
    got = reference.build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=prefix_lens)
    assert_same(got, walk(parents, num_nodes, prefix_lens))


# ---------------------------------------------------------------------------------------------
# The extension against the reference
# ---------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ragged", [True, False])
def test_extension_matches_reference(n, index_dtype, ragged):
    parents, num_nodes, prefix_lens = random_trees(9, n, seed=100 + n, index_dtype=index_dtype,
                                                   ragged=ragged)
    got = build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=prefix_lens,
                               backend="extension")
    assert_same(got, reference.build_tree_attention(parents, num_nodes=num_nodes,
                                                    prefix_lens=prefix_lens))


@needs_extension
def test_auto_uses_extension_on_cpu():
    assert _backend.use_extension("build_tree_attention", "auto", torch.device("cpu"))


@needs_extension
def test_extension_large_batch_threads():
    # Big enough for at::parallel_for to split the batch across threads.
    parents, num_nodes, prefix_lens = random_trees(300, 64, seed=5)
    assert_same(build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=prefix_lens,
                                     backend="extension"),
                reference.build_tree_attention(parents, num_nodes=num_nodes,
                                               prefix_lens=prefix_lens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unvalidated_bad_parents_agree(backend):
    # validate=False: nodes whose parent is not an earlier node become roots of their own;
    # num_nodes is clamped to [0, N]. Every backend does the same and stays in bounds.
    parents = torch.tensor([[5, 4, 2, 2**40, -7, 3], [-1, 0, 1, 2, 3, 4], [-1, 0, 1, 2, 3, 4]])
    num_nodes = torch.tensor([6, 1000, -3])
    out = build_tree_attention(parents, num_nodes=num_nodes, validate=False, backend=backend)
    assert out.depth.tolist() == [[0, 0, 0, 0, 0, 1], [0, 1, 2, 3, 4, 5], [0] * 6]
    assert torch.equal(out.mask[2], torch.eye(6, dtype=torch.bool))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_and_tensor_arguments(backend):
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    a = build_tree_attention(parents, num_nodes=2, prefix_lens=7, backend=backend)
    b = build_tree_attention(parents, num_nodes=torch.tensor([2, 2], dtype=torch.int32),
                             prefix_lens=torch.tensor(7), backend=backend)
    assert_same(a, b)
    assert a.position_ids.tolist() == [[7, 8, 7], [7, 8, 7]]


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

GOOD = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs, argument, needle", [
    (dict(parents=torch.tensor([[-1, 0, 3, 2]])), "parents", "cycle or forward edge"),  # 2 <-> 3
    (dict(parents=torch.tensor([[-1, 0, 0, 5]])), "parents", "parents[0, 3] = 5"),      # forward
    (dict(parents=torch.tensor([[-1, 0, 2, 1]])), "parents", "parents[0, 2] = 2"),      # self
    (dict(parents=torch.tensor([[-1, 0, -1, 1]])), "parents", "without a parent"),
    (dict(parents=torch.tensor([[0, 0, 0, 1]])), "parents", "node 0 is the root"),
    (dict(parents=GOOD, num_nodes=torch.tensor([4, 5])), "num_nodes", "got 5 for request 1"),
    (dict(parents=GOOD, num_nodes=0), "num_nodes", "[1, 4]"),
    (dict(parents=GOOD, prefix_lens=torch.tensor([0, -2])), "prefix_lens", "got -2"),
    (dict(parents=GOOD, num_nodes=torch.tensor([4, 4, 4])), "num_nodes", "[2]"),
    (dict(parents=GOOD[0]), "parents", "2-D"),
    (dict(parents=GOOD[:, :0]), "parents", "at least one node"),
])
def test_bad_input_raises_value_error(backend, kwargs, argument, needle):
    with pytest.raises(ValueError, match=rf"^{argument}: ") as err:
        build_tree_attention(**kwargs, backend=backend)
    assert needle in str(err.value)


def test_padding_parents_are_not_validated():
    out = build_tree_attention(torch.tensor([[-1, 0, 77, -5]]), num_nodes=2)
    assert out.depth.tolist() == [[0, 1, 0, 0]]


@pytest.mark.parametrize("kwargs, argument", [
    (dict(parents=GOOD.float()), "parents"),
    (dict(parents=GOOD.tolist()), "parents"),
    (dict(parents=GOOD, num_nodes=2.5), "num_nodes"),
    (dict(parents=GOOD, prefix_lens=torch.tensor([0.0, 1.0])), "prefix_lens"),
])
def test_bad_types_raise_type_error(kwargs, argument):
    with pytest.raises(TypeError, match=rf"^{argument}: "):
        build_tree_attention(**kwargs)


def test_unknown_backend():
    with pytest.raises(ValueError, match="^backend: "):
        build_tree_attention(GOOD, backend="triton")


# ---------------------------------------------------------------------------------------------
# Custom-op plumbing
# ---------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("optional", [True, False])
def test_opcheck(optional):
    parents, num_nodes, prefix_lens = random_trees(3, 40, seed=3, index_dtype=torch.int32)
    args = (parents, num_nodes, prefix_lens) if optional else (parents, None, None)
    torch.library.opcheck(torch.ops.specdec.build_tree_attention.default, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    parents, num_nodes, prefix_lens = random_trees(4, 20, seed=9)

    @torch.compile(fullgraph=True)
    def metadata(parents, num_nodes, prefix_lens):
        out = specdec_kernels.build_tree_attention(parents, num_nodes=num_nodes,
                                                   prefix_lens=prefix_lens, backend=backend,
                                                   validate=False)
        return out.mask, out.packed_mask, out.depth, out.position_ids

    got = TreeAttention(*metadata(parents, num_nodes, prefix_lens))
    assert_same(got, walk(parents, num_nodes, prefix_lens))


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@needs_cuda
@needs_extension
@pytest.mark.parametrize("n", SIZES + [1000])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cuda_extension_matches_reference(n, index_dtype):
    assert _backend.use_extension("build_tree_attention", "auto", torch.device("cuda"))
    parents, num_nodes, prefix_lens = random_trees(6, n, seed=200 + n, index_dtype=index_dtype)
    got = build_tree_attention(parents.cuda(), num_nodes=num_nodes.cuda(),
                               prefix_lens=prefix_lens.cuda(), backend="extension")
    assert got.mask.is_cuda
    assert_same(got, reference.build_tree_attention(parents, num_nodes=num_nodes,
                                                    prefix_lens=prefix_lens))


@needs_cuda
@needs_extension
def test_cuda_unvalidated_bad_parents_agree():
    parents = torch.tensor([[5, 4, 2, 2**40, -7, 3], [-1, 0, 1, 2, 3, 4]])
    num_nodes = torch.tensor([6, 1000])
    got = build_tree_attention(parents.cuda(), num_nodes=num_nodes.cuda(), validate=False)
    assert_same(got, reference.build_tree_attention(parents, num_nodes=num_nodes))


@needs_cuda
@needs_extension
def test_cuda_graph_capture():
    parents, num_nodes, prefix_lens = (t.cuda() for t in random_trees(4, 40, seed=41))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=prefix_lens,
                                   validate=False)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(out, reference.build_tree_attention(parents.cpu(), num_nodes=num_nodes.cpu(),
                                                    prefix_lens=prefix_lens.cpu()))

"""The engine adapters' C++ CPU ops (csrc/torch/ops_adapters_cpu.cpp, wrapped in
``specdec_kernels._cpu``) against the adapters' own torch code, which stays the path on other
devices and while tracing: the same outputs on random inputs and on malformed ones (lists
that are not trees, indices out of range, duplicates) for int32 and int64 indices and both
counter dtypes. Each comparison also runs once against a torch result with a planted fault,
which it must catch.

One documented exception: FlashInfer's counters compare ``u * q < p`` in float64 with the
row sum of ``target_probs`` taken in sequence, where torch sums in its own order; the two can
differ only where ``u * q`` lies within an ulp of ``p`` (probability about 1e-16 per draft
here: none of these inputs)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from specdec_kernels import _cpu
from specdec_kernels.adapters import _sglang_trees, flashinfer, sglang
from specdec_kernels.adapters.vllm import mrv2_0_33

pytestmark = pytest.mark.skipif(not _cpu.ADAPTERS, reason="the extension's adapter ops are "
                                "not built")

INDEX = (torch.int32, torch.int64)


@contextlib.contextmanager
def torch_code():
    """The adapters' torch code: the C++ ops switched off."""
    saved, _cpu.ADAPTERS = _cpu.ADAPTERS, False
    try:
        yield
    finally:
        _cpu.ADAPTERS = saved


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --- FlashInfer's counters ----------------------------------------------------------------


def _flashinfer_case(seed, dtype, id_dtype, counter_dtype, per_request_offset):
    gen = _gen(seed)
    b, k, v = 6, 5, 11
    target = torch.rand(b, k + 1, v, generator=gen, dtype=torch.float64)
    target[target < 0.3] = 0  # zeros: p = 0 rejects
    target[0, 1] = 0          # a row with no mass: p = NaN, never passes
    target = target.to(dtype)
    draft = torch.softmax(torch.randn(b, k, v, generator=gen), -1).to(dtype)
    ids = torch.randint(-1, v + 1, (b, k), generator=gen).to(id_dtype)  # some out of range
    num_accepted = torch.randint(0, k + 1, (b,), generator=gen).to(torch.int32)
    seeds = torch.randint(-2**63, 2**63 - 1, (b,), generator=gen)
    offsets = torch.randint(0, 2**40, (b if per_request_offset else 1,), generator=gen)
    counters = [torch.randint(0, 9, (b,), generator=gen).to(counter_dtype) for _ in range(2)]
    return target, draft, ids, num_accepted, seeds, offsets, counters


def _flashinfer_torch(target, draft, ids, num_accepted, seeds, offsets, counters):
    with torch_code():
        independent = flashinfer._independently_accepted(target, draft, ids, num_accepted,
                                                         seeds, offsets)
    accepted, emitted = (c.clone() for c in counters)
    accepted.add_(independent.to(accepted.dtype))
    emitted.add_(num_accepted.to(emitted.dtype))
    return accepted, emitted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("id_dtype", INDEX)
@pytest.mark.parametrize("counter_dtype", INDEX)
def test_flashinfer_counts_equal_the_torch_code(dtype, id_dtype, counter_dtype):
    for seed in range(8):
        case = _flashinfer_case(seed, dtype, id_dtype, counter_dtype, seed % 2 == 0)
        *args, counters = case
        expected = _flashinfer_torch(*args, counters)
        got = [c.clone() for c in counters]
        assert _cpu.flashinfer_counts(*args, *got)
        assert [g.dtype for g in got] == [counter_dtype] * 2
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        # Planted fault: another step's offset changes the uniforms, and the test sees it.
        if seed == 0:
            target, draft, ids, num_accepted, seeds, offsets = args
            num_accepted = torch.zeros_like(num_accepted)  # every later draft counts
            planted = _flashinfer_torch(target, draft, ids, num_accepted, seeds, offsets + 1,
                                        counters)
            fresh = [c.clone() for c in counters]
            _cpu.flashinfer_counts(target, draft, ids, num_accepted, seeds, offsets, *fresh)
            assert not torch.equal(fresh[0], planted[0])


def test_flashinfer_adapter_takes_the_op_and_its_fallback_agrees():
    gen = _gen(3)
    target = torch.softmax(torch.randn(4, 4, 9, generator=gen), -1)
    draft = torch.softmax(torch.randn(4, 3, 9, generator=gen), -1)
    ids = torch.randint(0, 9, (4, 3), generator=gen, dtype=torch.int32)
    kwargs = dict(seed=torch.arange(4) + 5, offset=torch.full((4,), 3))
    calls = []
    real = _cpu.flashinfer_counts
    try:
        _cpu.flashinfer_counts = lambda *a: calls.append(1) or real(*a)
        fast = flashinfer.chain_speculative_sampling(draft, ids, target, **kwargs)
    finally:
        _cpu.flashinfer_counts = real
    assert calls == [1]
    with torch_code():
        slow = flashinfer.chain_speculative_sampling(draft, ids, target, **kwargs)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


# --- SGLang's trees and outputs -----------------------------------------------------------


def _random_parents(gen, b, n):
    """``[b, n]`` random trees: node ``i``'s parent uniform below ``i``."""
    bound = torch.arange(n).clamp(min=1).expand(b, n)
    parents = (torch.rand(b, n, generator=gen) * bound).long()
    parents[:, 0] = -1
    return parents


def _parents_torch(next_token, next_sibling, candidates):
    """``(parents, one_tree)`` of the torch code."""
    with torch_code():
        parents = _sglang_trees.tree_from_sglang(next_token, next_sibling, candidates,
                                                 validate=False).parents
        try:
            _sglang_trees.tree_from_sglang(next_token, next_sibling, candidates, validate=True)
            one_tree = True
        except ValueError:
            one_tree = False
    return parents, one_tree


@pytest.mark.parametrize("index_dtype", INDEX)
def test_sglang_parents_equal_the_torch_code(index_dtype):
    gen = _gen(1)
    for trial in range(60):
        b, n = int(torch.randint(1, 5, (1,), generator=gen)), int(
            torch.randint(1, 12, (1,), generator=gen))
        if trial % 2 == 0:  # SGLang's lists of a real tree
            parents = _random_parents(gen, b, n)
            tree = _sglang_trees.tree_to_sglang(parents, torch.zeros_like(parents))
            lists = [tree.retrive_next_token, tree.retrive_next_sibling]
            if trial % 4 == 0 and n > 2:  # one link broken: not a tree any more
                lists[trial % 8 // 4][0, int(torch.randint(0, n, (1,), generator=gen))] = \
                    int(torch.randint(-3, n + 2, (1,), generator=gen))
        else:  # garbage lists: cycles, repeats, out-of-range links
            lists = [torch.randint(-3, n + 2, (b, n), generator=gen) for _ in range(2)]
        lists = [x.to(index_dtype) for x in lists]
        candidates = torch.zeros(b, n, dtype=index_dtype)
        expected, one_tree = _parents_torch(*lists, candidates)
        got, ok = _cpu.sglang_parents(*lists)
        assert torch.equal(got, expected), (trial, lists)
        assert ok == one_tree, (trial, lists)
        if trial % 2 == 0 and trial % 4 != 0:
            assert ok and torch.equal(got, parents)
    # Planted fault: the torch result with one parent changed is told apart.
    planted = expected.clone()
    planted[0, -1] += 1
    assert not torch.equal(got, planted)


def _passes(check, *args) -> bool:
    """Whether the torch checks ``check(*args)`` pass (False: they raised a ValueError)."""
    try:
        check(*args)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("index_dtype", INDEX)
def test_sglang_output_checks_equal_the_torch_code(index_dtype):
    gen = _gen(2)
    outcomes = set()
    for trial in range(60):
        b, n = 3, int(torch.randint(1, 9, (1,), generator=gen))
        parents = _random_parents(gen, b, n)
        predicts = torch.zeros(b * n + int(torch.randint(0, 3, (1,), generator=gen)),
                               dtype=torch.int32)
        retrive_index = (torch.arange(b * n).view(b, n)
                         + (torch.randint(-1, 2, (b, n), generator=gen) if trial % 3 == 0 else 0))
        retrive_index = retrive_index.to(index_dtype)
        steps = int(torch.randint(1, n + 2, (1,), generator=gen))
        expected = _passes(sglang._check_outputs, retrive_index, predicts, parents, steps)
        assert _cpu.sglang_outputs_ok(retrive_index, predicts.numel(), parents, steps) == \
            expected, trial
        outcomes.add(expected)
    assert outcomes == {True, False}  # both answers were met (the comparison has power)


def _write_case(gen, b, n, columns, index_dtype):
    path_len = int(torch.randint(1, n + 2, (1,), generator=gen))  # (its own stride, not N)
    accepted_nodes = torch.randint(-1, n, (b, path_len), generator=gen).to(torch.int32)
    accepted_nodes[:, 0] = 0
    tokens = torch.randint(-1, 50, (b, path_len), generator=gen).to(torch.int32)
    num_accepted = torch.randint(-1, path_len + 2, (b,), generator=gen).to(torch.int32)
    size = b * n
    # Duplicates and out-of-range flat indices (clamped) included.
    retrive_index = torch.randint(-2, size + 2, (b, n), generator=gen).to(index_dtype)
    outputs = (torch.randint(-5, 5, (size,), generator=gen).to(torch.int32),
               torch.randint(-5, 5, (b, columns), generator=gen).to(torch.int32),
               torch.randint(-5, 5, (b,), generator=gen).to(torch.int32))
    return outputs, (retrive_index, accepted_nodes, tokens, num_accepted)


@pytest.mark.parametrize("index_dtype", INDEX)
@pytest.mark.parametrize("vocab", [None, 50])
def test_sglang_write_path_equals_the_torch_code(index_dtype, vocab):
    gen = _gen(4)
    for trial in range(40):
        b, n = int(torch.randint(1, 4, (1,), generator=gen)), int(
            torch.randint(1, 7, (1,), generator=gen))
        columns = int(torch.randint(1, n + 3, (1,), generator=gen))
        outputs, inputs = _write_case(gen, b, n, columns, index_dtype)
        expected = [t.clone() for t in outputs]
        with torch_code():
            sglang._write_path(*expected, *inputs, vocab)
        got = [t.clone() for t in outputs]
        assert _cpu.sglang_write_path(*got, *inputs, vocab)
        for g, e in zip(got, expected):
            assert torch.equal(g, e), trial
    planted = [t.clone() for t in expected]  # Planted fault: the root's token changed, seen.
    planted[0][int(expected[1][0, 0])] += 1
    assert not torch.equal(got[0], planted[0])


def _greedy_torch(outputs, inputs):
    got = [t.clone() for t in outputs]
    with torch_code():
        sglang.verify_tree_greedy(*got, *inputs, validate=False)
    return got


@pytest.mark.parametrize("index_dtype", INDEX)
def test_sglang_greedy_equals_the_torch_code(index_dtype):
    gen = _gen(7)
    for trial in range(50):
        b, n = int(torch.randint(1, 4, (1,), generator=gen)), int(
            torch.randint(1, 10, (1,), generator=gen))
        parents = _random_parents(gen, b, n)
        candidates = torch.randint(0, 4, (b, n), generator=gen)  # small: repeats, matches
        tree = _sglang_trees.tree_to_sglang(parents, candidates)
        lists = [tree.retrive_next_token, tree.retrive_next_sibling]
        broken = trial % 5 == 4 and n > 2
        if broken:  # not one tree: the op declines, the torch code answers
            lists[0][0, int(torch.randint(0, n, (1,), generator=gen))] = n - 1
        size = b * n + int(torch.randint(0, 3, (1,), generator=gen))
        retrive_index = tree.retrive_index + (
            torch.randint(-1, 2, (b, n), generator=gen) if trial % 3 == 0 else 0)
        target_predict = torch.randint(0, 4, (b, n), generator=gen)
        columns = int(torch.randint(1, n + 2, (1,), generator=gen))
        outputs = (torch.randint(-3, 3, (size,), generator=gen).to(torch.int32),
                   torch.full((b, columns), -1, dtype=torch.int32), torch.zeros(b, dtype=torch.int32))
        inputs = [x.to(index_dtype) for x in (candidates, retrive_index, *lists, target_predict)]
        expected = _greedy_torch(outputs, inputs)
        got = [t.clone() for t in outputs]
        one_tree = _cpu.sglang_parents(*inputs[2:4])[1]
        assert _cpu.sglang_greedy(*got, *inputs) == one_tree
        if not one_tree:
            assert all(torch.equal(g, o) for g, o in zip(got, outputs))  # nothing written
            continue
        for g, e in zip(got, expected):
            assert torch.equal(g, e), (trial, inputs)
        compared = got, expected
    got, expected = compared  # Planted fault: the root's emitted token changed, seen.
    planted = [t.clone() for t in expected]
    planted[0][int(got[1][0, 0])] += 1
    assert not torch.equal(got[0], planted[0])


# --- vLLM MRV2's layout and outputs -------------------------------------------------------


def _mrv2_case(gen, trial, index_dtype):
    b = int(torch.randint(0, 5, (1,), generator=gen))
    k = 3
    counts = torch.randint(1, k + 2, (b,), generator=gen)
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    num_logits = int(cu[-1]) if b else int(torch.randint(0, 3, (1,), generator=gen))
    if trial % 3 == 0 and b:  # unvalidated offsets: unsorted, past the end, negative
        cu = cu + torch.randint(-2, 3, (b + 1,), generator=gen)
        cu = cu.clamp(min=-num_logits)  # (torch indexing raises below -num_logits)
    num_slots = int(torch.randint(max(b, 1), 8, (1,), generator=gen))
    idx_mapping = torch.randint(-1 if trial % 3 == 0 else 0, num_slots + (trial % 3 == 0),
                                (b,), generator=gen)
    temperature = torch.rand(num_slots + 1, generator=gen)
    temperature[torch.rand(num_slots + 1, generator=gen) < 0.4] = 0  # greedy slots
    temperature = temperature.to([torch.float32, torch.float64, torch.bfloat16][trial % 3])
    seed = torch.randint(-2**63, 2**63 - 1, (num_slots,), generator=gen)
    draft_sampled = torch.randint(0, 100, (num_logits,), generator=gen).to(index_dtype)
    pos = torch.randint(0, 1000, (num_logits,), generator=gen).to(index_dtype)
    row_mapping, num_rows = None, 0
    if trial % 2:
        num_rows = int(torch.randint(1, 4, (1,), generator=gen))
        row_mapping = torch.randint(-1, num_rows + 1, (num_slots,), generator=gen).to(index_dtype)
    return (cu.to(index_dtype), draft_sampled, pos, idx_mapping.to(index_dtype), temperature,
            seed, b, num_logits, num_slots, row_mapping, num_rows)


@pytest.mark.parametrize("index_dtype", INDEX)
def test_mrv2_layout_equals_the_torch_code(index_dtype):
    gen = _gen(5)
    compared = 0
    for trial in range(80):
        case = _mrv2_case(gen, trial, index_dtype)
        with torch_code():
            try:
                expected = mrv2_0_33.packed_layout(*case)
            except IndexError:  # (rows without a request: not an input the torch code takes)
                continue
        got = mrv2_0_33.packed_layout(*case)
        for field, g, e in zip(expected._fields, got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e), (trial, field, case)
        compared += 1
        if got.first_pos.numel():
            last = got, expected
    assert compared >= 70
    got, expected = last
    planted = expected._replace(first_pos=expected.first_pos + 1)  # Planted fault: seen.
    assert not all(torch.equal(g, e) for g, e in zip(got, planted))


def _indices_pass_torch(cu, idx_mapping, slot_sizes, num_logits, k, row_mapping, num_rows):
    from specdec_kernels.adapters.vllm import mrv2_0_34
    return _passes(mrv2_0_33._check_indices, cu, idx_mapping, slot_sizes, num_logits, k) and (
        row_mapping is None or _passes(mrv2_0_34._check_rows, row_mapping, idx_mapping, num_rows))


@pytest.mark.parametrize("index_dtype", INDEX)
def test_mrv2_index_checks_equal_the_torch_code(index_dtype):
    gen = _gen(8)
    outcomes = set()
    for trial in range(120):
        b, k = int(torch.randint(0, 5, (1,), generator=gen)), 3
        counts = torch.randint(1, k + 2, (b,), generator=gen)
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
        num_logits = int(cu[-1])
        fault = trial % 4
        if fault == 1 and b:  # a count out of range, or offsets off by one
            cu[int(torch.randint(1, b + 1, (1,), generator=gen))] += int(
                torch.randint(-2, 3, (1,), generator=gen))
        if fault == 2:
            num_logits += 1
        slot_sizes = {"temperature": 6, "seed": int(torch.randint(3, 7, (1,), generator=gen))}
        idx_mapping = torch.randint(-1 if fault == 3 else 0, min(slot_sizes.values()) + 1,
                                    (b,), generator=gen)
        row_mapping, num_rows = None, 0
        if trial % 2:
            num_rows = 3
            slot_sizes["draft_logits_cache"] = 6
            row_mapping = torch.randint(-1 - (fault == 3), num_rows + (fault == 3), (6,),
                                        generator=gen).to(index_dtype)
        cu, idx_mapping = cu.to(index_dtype), idx_mapping.to(index_dtype)
        expected = _indices_pass_torch(cu, idx_mapping, slot_sizes, num_logits, k, row_mapping,
                                       num_rows)
        assert _cpu.mrv2_indices_ok(cu, idx_mapping, min(slot_sizes.values()), num_logits, k,
                                    row_mapping, num_rows) == expected, trial
        outcomes.add(expected)
    assert outcomes == {True, False}  # both answers met: the comparison has power


@pytest.mark.parametrize("zero_missing", [False, True])
def test_mrv2_outputs_equal_the_torch_code(zero_missing):
    gen = _gen(6)
    for trial in range(30):
        b, width = int(torch.randint(0, 5, (1,), generator=gen)), int(
            torch.randint(1, 6, (1,), generator=gen))
        tokens = torch.randint(-1, 20, (b, width), generator=gen).to(torch.int32)
        # (counts below 0 and past the width too: the bound of the writes)
        num_accepted = torch.randint(-1, width + 2, (b,), generator=gen).to(torch.int32)
        with torch_code():
            expected = mrv2_0_33.mrv2_outputs(tokens, num_accepted, zero_missing)
        got = mrv2_0_33.mrv2_outputs(tokens, num_accepted, zero_missing)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e), trial
        if tokens.numel():
            assert got[0].data_ptr() != tokens.data_ptr()  # a new tensor: ours is not written


def test_the_sglang_and_mrv2_adapters_take_the_ops():
    """On plain CPU tensors the adapters call the ops (and agree with their torch code)."""
    from bench.ops.host import _inputs, adapter_calls
    x = _inputs()
    calls = adapter_calls(x)
    names = ("sglang_parents", "sglang_write_path", "sglang_greedy", "mrv2_layout",
             "mrv2_outputs", "mrv2_indices_ok", "sglang_outputs_ok")
    for (entry, mode), call in calls.items():
        if not entry.startswith(("SGLang", "vLLM MRV2", "vLLM 0.34")):
            continue
        seen = []
        real = {n: getattr(_cpu, n) for n in names}
        try:
            for n, f in real.items():
                setattr(_cpu, n, (lambda n, f: lambda *a: seen.append(n) or f(*a))(n, f))
            call()
        finally:
            for n, f in real.items():
                setattr(_cpu, n, f)
        expected = {"SGLang verify_tree_greedy": {"sglang_parents", "sglang_greedy"},
                    "SGLang tree_speculative_sampling_target_only": {"sglang_parents",
                                                                     "sglang_write_path"}}.get(
            entry, {"mrv2_layout", "mrv2_outputs"})
        assert expected <= set(seen), (entry, mode, seen)
        if "validate=False" not in mode:  # the validated defaults check in C++ too
            assert ({"mrv2_indices_ok"} if "MRV2" in entry else {"sglang_outputs_ok"}) & set(seen)

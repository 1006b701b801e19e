"""``draft_slots`` and ``draft_temperature`` of ``verify_chain`` / ``verify_chain_packed``
(docs/semantics.md section 3.1): per-slot draft rows ``[S, K', V']`` read in place give, token
for token, the op's answer on the gathered rows (reference, C++, Triton; padded and packed;
permuted, duplicate and unused slots; non-contiguous tensors; K' > K, V' > V), a draft
temperature is the logits divided by it, 0 is one-hot at the row's arg-max, bad values are
errors naming the argument, and the MRV2 adapter hands the engine's own tensor to the op."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _cpu, _ops
from specdec_kernels.testing import forbid_host_sync

from conftest import DEVICE, _triton_param

# "auto" on CPU tensors is the C++ path where _C is built (else the reference again).
BACKENDS = ["reference", pytest.param("auto", marks=pytest.mark.skipif(
    not _cpu.AVAILABLE, reason="_C not built")), _triton_param("specdec_kernels.triton.chain")]
B, K, V, S = 4, 3, 37, 6
SLOTS = [4, 0, 4, 2]  # permuted, a duplicate, slots 1, 3 and 5 unused


def _device(backend):
    return DEVICE if backend == "triton" else "cpu"


def _per_slot(gen, dtype, probs=False, extra_k=2, extra_v=5):
    """``[S, K', V']`` draft rows with non-trivial strides: the transpose of a ``[K', S, V']``
    tensor, sliced in its vocabulary (a unit vocabulary stride, nothing else standard)."""
    raw = 2 * torch.randn(K + extra_k, S, V + extra_v + 3, generator=gen)
    if probs:
        raw = torch.softmax(raw, -1)
    return raw.to(dtype).transpose(0, 1)[:, :, 1:V + extra_v + 1]


def _chain_inputs(gen, device, dtype, probs=False):
    target = (2 * torch.randn(B, K + 1, V, generator=gen)).to(dtype)
    drafts = torch.randint(0, V, (B, K), generator=gen)
    per_slot = _per_slot(gen, dtype, probs)
    slots = torch.tensor(SLOTS)
    gathered = per_slot[slots][:, :K, :V]  # what the engine would have had to copy
    assert not per_slot.is_contiguous() and per_slot.shape[1] > K and per_slot.shape[2] > V
    to = lambda x: x.to(device)  # noqa: E731
    return to(target), to(drafts), to(per_slot), to(slots), to(gathered)


def _params(device, temperature=(0.7, 1.0, 0.0, 1.3)):
    return dict(temperature=torch.tensor(temperature, device=device),
                seed=torch.tensor([1, 2, 3, 4], device=device), offset=5,
                num_draft_tokens=torch.tensor([3, 2, 1, 3], device=device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slotted_chain_equals_the_gathered_rows(backend, method, kind, dtype):
    device = _device(backend)
    gen = torch.Generator().manual_seed(hash((method, kind, str(dtype))) % 2**31)
    for _ in range(3):
        target, drafts, per_slot, slots, gathered = _chain_inputs(
            gen, device, dtype, probs=kind == "draft_probs")
        kw = dict(**_params(device), top_k=torch.tensor([0, 9, 0, 20], device=device),
                  method=method, backend=backend, return_logprobs="processed")
        expected = sk.verify_chain(target, drafts, **{kind: gathered}, **kw)
        got = sk.verify_chain(target, drafts, **{kind: per_slot}, draft_slots=slots, **kw)
        assert torch.equal(got.output_token_ids, expected.output_token_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)
        assert torch.equal(got.logprobs.isnan(), expected.logprobs.isnan())


def _packed_inputs(gen, device, dtype, probs=False):
    cu = torch.tensor([0, 3, 5, 5, 6])
    counts = cu[1:] - cu[:-1]
    total = int(cu[-1])
    target = (2 * torch.randn(total + B, V, generator=gen)).to(dtype)
    drafts = torch.randint(0, V, (total,), generator=gen)
    per_slot = _per_slot(gen, dtype, probs, extra_k=1)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(B), counts)
    position = torch.arange(total) - cu[request]
    gathered = per_slot[slots.long()[request], position, :V]  # the packed copy [T, V]
    to = lambda x: x.to(device)  # noqa: E731
    return to(target), to(drafts), to(cu), to(per_slot), to(slots), to(gathered), request


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
def test_slotted_packed_chain_equals_the_gathered_rows(backend, method, kind):
    device = _device(backend)
    gen = torch.Generator().manual_seed(7 + (method == "block") + 2 * (kind == "draft_probs"))
    for dtype in (torch.float32, torch.bfloat16):
        target, drafts, cu, per_slot, slots, gathered, _ = _packed_inputs(
            gen, device, dtype, probs=kind == "draft_probs")
        kw = dict(max_draft_tokens=K, temperature=torch.tensor([0.7, 1.0, 0.0, 1.3],
                                                               device=device),
                  seed=torch.tensor([1, 2, 3, 4], device=device), offset=5, method=method,
                  backend=backend)
        expected = sk.verify_chain_packed(target, drafts, cu, **{kind: gathered}, **kw)
        got = sk.verify_chain_packed(target, drafts, cu, **{kind: per_slot}, draft_slots=slots,
                                     **kw)
        assert torch.equal(got.output_token_ids, expected.output_token_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["token", "block"])
def test_draft_temperature_is_dividing_the_logits_yourself(backend, method):
    """Powers of two divide exactly, so both sides see the same floats: the target at T = 1
    without filters processes the divided draft logits as they are."""
    device = _device(backend)
    gen = torch.Generator().manual_seed(11 + (method == "block"))
    draft_temperature = torch.tensor([0.5, 2.0, 1.0, 4.0], device=device)
    for dtype in (torch.float32, torch.bfloat16):
        target, drafts, per_slot, slots, gathered = _chain_inputs(gen, device, dtype)
        kw = dict(**_params(device, (1.0, 1.0, 0.0, 1.0)), method=method, backend=backend)
        divided = (gathered.float() / draft_temperature[:, None, None]).to(dtype)
        expected = sk.verify_chain(target, drafts, draft_logits=divided, **kw)
        got = sk.verify_chain(target, drafts, draft_logits=per_slot, draft_slots=slots,
                              draft_temperature=draft_temperature, **kw)
        assert torch.equal(got.output_token_ids, expected.output_token_ids)
        unslotted = sk.verify_chain(target, drafts, draft_logits=gathered,
                                    draft_temperature=draft_temperature, **kw)
        assert torch.equal(unslotted.output_token_ids, expected.output_token_ids)
        # packed: the same, through the slots
        target_p, drafts_p, cu, per_slot_p, slots_p, gathered_p, request = _packed_inputs(
            gen, device, dtype)
        kw_p = dict(max_draft_tokens=K, temperature=torch.tensor([1.0, 1.0, 0.0, 1.0],
                                                                 device=device),
                    seed=torch.tensor([5, 6, 7, 8], device=device), method=method,
                    backend=backend)
        divided_p = (gathered_p.float() / draft_temperature[request.to(device), None]).to(dtype)
        expected = sk.verify_chain_packed(target_p, drafts_p, cu, draft_logits=divided_p, **kw_p)
        got = sk.verify_chain_packed(target_p, drafts_p, cu, draft_logits=per_slot_p,
                                     draft_slots=slots_p, draft_temperature=draft_temperature,
                                     **kw_p)
        assert torch.equal(got.output_token_ids, expected.output_token_ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["token", "block"])
def test_draft_temperature_zero_is_one_hot_at_the_draft_rows_arg_max(backend, method):
    """T_q = 0 for a sampled request: the drafter took the row's arg-max, q is one-hot there
    (lowest id among ties): the tokens of draft_probs one-hot at that id. Ties included."""
    device = _device(backend)
    gen = torch.Generator().manual_seed(13 + (method == "block"))
    target, drafts, per_slot, slots, gathered = _chain_inputs(gen, device, torch.float32)
    per_slot = per_slot.clone()
    per_slot[4, 0, 3] = per_slot[4, 0, 10] = per_slot[4, 0].max() + 1  # a tie: id 3 wins
    gathered = per_slot[slots][:, :K, :V]
    drafts[:, 0] = gathered[:, 0].argmax(-1)  # the drafter's tokens where it took the arg-max
    one_hot = torch.zeros_like(gathered).scatter_(-1, gathered.argmax(-1, keepdim=True), 1.0)
    kw = dict(**_params(device), method=method, backend=backend)
    expected = sk.verify_chain(target, drafts, draft_probs=one_hot, **kw)
    got = sk.verify_chain(target, drafts, draft_logits=per_slot, draft_slots=slots,
                          draft_temperature=0.0, **kw)
    assert torch.equal(got.output_token_ids, expected.output_token_ids)
    mixed = torch.tensor([0.0, 1.0, 0.0, 0.5], device=device)  # greedy target (req 2) ignores q
    expected = sk.verify_chain(
        target, drafts, draft_probs=torch.where((mixed == 0)[:, None, None], one_hot,
                                                torch.softmax(gathered / mixed.clamp(min=0.5)
                                                              [:, None, None], -1)), **kw)
    got = sk.verify_chain(target, drafts, draft_logits=per_slot, draft_slots=slots,
                          draft_temperature=mixed, **kw)
    assert torch.equal(got.num_accepted[mixed == 0], expected.num_accepted[mixed == 0])
    assert torch.equal(got.output_token_ids[mixed == 0], expected.output_token_ids[mixed == 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unvalidated_slots_are_clamped(backend):
    device = _device(backend)
    gen = torch.Generator().manual_seed(17)
    target, drafts, per_slot, _, _ = _chain_inputs(gen, device, torch.float32)
    kw = dict(**_params(device), backend=backend, validate=False)
    wild = torch.tensor([-5, S, 2**40, 1], device=device)
    clamped = wild.clamp(0, S - 1)
    got = sk.verify_chain(target, drafts, draft_logits=per_slot, draft_slots=wild, **kw)
    expected = sk.verify_chain(target, drafts, draft_logits=per_slot, draft_slots=clamped, **kw)
    assert torch.equal(got.output_token_ids, expected.output_token_ids)


def test_slotted_backends_agree():
    """The three backends on one slotted call with a draft temperature (small V: no
    decision falls within rounding of its threshold here)."""
    gen = torch.Generator().manual_seed(19)
    target, drafts, per_slot, slots, _ = _chain_inputs(gen, "cpu", torch.float32)
    kw = dict(**_params("cpu"), draft_logits=per_slot, draft_slots=slots,
              draft_temperature=torch.tensor([0.8, 1.5, 0.0, 0.0]))
    answers = [sk.verify_chain(target, drafts, backend="reference", **kw)]
    if _cpu.AVAILABLE:
        answers.append(sk.verify_chain(target, drafts, backend="auto", **kw))
    for other in answers[1:]:
        assert torch.equal(other.output_token_ids, answers[0].output_token_ids)


# --------------------------------------------------------------------------------- validation

def _bad_calls():
    gen = torch.Generator().manual_seed(23)
    target, drafts, per_slot, slots, gathered = _chain_inputs(gen, "cpu", torch.float32)
    base = dict(draft_logits=per_slot, draft_slots=slots)
    return target, drafts, [
        ("draft_slots", dict(base, draft_slots=torch.tensor([0, 1, S, 2])), "[0, 6)"),
        ("draft_slots", dict(base, draft_slots=torch.tensor([0, -1, 1, 2])), "got -1"),
        ("draft_slots", dict(base, draft_slots=torch.tensor([0, 1, 2])), "shape [4]"),
        ("draft_slots", dict(base, draft_slots=slots.float()), "dtype"),
        ("draft_slots", dict(draft_slots=slots), "neither"),
        ("draft_logits", dict(base, draft_logits=per_slot[:, :K - 1]), "K' >= "),
        ("draft_logits", dict(base, draft_logits=per_slot[:, :, :V - 1]), "V' >= V"),
        ("draft_logits", dict(base, draft_logits=per_slot[0]), "[S, K', V']"),
        ("draft_probs", dict(draft_probs=torch.softmax(per_slot, -1)[..., :V - 2],
                             draft_slots=slots), "V' >= V"),
        ("draft_temperature", dict(base, draft_temperature=-1.0), "finite values >= 0"),
        ("draft_temperature", dict(base, draft_temperature=float("inf")), ">= 0"),
        ("draft_temperature", dict(base, draft_temperature=torch.tensor(
            [1.0, float("nan"), 1.0, 1.0])), ">= 0"),
        ("draft_temperature", dict(base, draft_temperature=torch.ones(3)), "[4]"),
        ("draft_temperature", dict(draft_probs=torch.softmax(gathered, -1),
                                   draft_temperature=1.0), "draft_logits only"),
        ("draft_temperature", dict(draft_temperature=1.0), "draft_logits only"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls()[2])))
@pytest.mark.parametrize("packed", [False, True])
def test_bad_slots_and_temperatures_name_the_argument(case, packed):
    target, drafts, calls = _bad_calls()
    name, kwargs, hint = calls[case]
    if packed:  # the same arguments on the packed layout of the same requests
        cu = torch.arange(0, (B + 1) * K, K)
        target, drafts = target[:, :K].reshape(-1, V), drafts.reshape(-1)
        target = torch.cat([target, torch.zeros(B, V)])
        if "draft_slots" not in kwargs and "draft_logits" not in kwargs \
                and "draft_probs" in kwargs:
            kwargs = dict(kwargs, draft_probs=kwargs["draft_probs"].reshape(-1, V))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises((ValueError, TypeError), match=name) as error:
        if packed:
            sk.verify_chain_packed(target, drafts, cu, max_draft_tokens=K, temperature=0.8,
                                   **kwargs)
        else:
            sk.verify_chain(target, drafts, temperature=0.8, **kwargs)
    assert hint in str(error.value), str(error.value)
    assert torch.equal(torch.get_rng_state(), state)  # seed=None drew nothing


# --------------------------------------------------------------------------------- graph safety

class GraphInputs(NamedTuple):
    target: torch.Tensor        # packed [T + B, V], T = 6
    drafts: torch.Tensor        # [T]
    cu: torch.Tensor            # [B + 1]
    per_slot: torch.Tensor      # [S, K', V'], non-contiguous
    slots: torch.Tensor         # [B] int32
    draft_temperature: torch.Tensor  # [B], a 0 among them
    seeds: torch.Tensor         # [B]
    padded_target: torch.Tensor  # [B, K, V]: a padded chain of K - 1 drafts
    padded_drafts: torch.Tensor  # [B, K - 1]


def _graph_inputs(device="cpu") -> GraphInputs:
    gen = torch.Generator().manual_seed(29)
    target, drafts, cu, per_slot, slots, _, _ = _packed_inputs(gen, device, torch.float32)
    return GraphInputs(target, drafts, cu, per_slot, slots,
                       torch.tensor([0.5, 0.0, 1.5, 1.0], device=device),
                       torch.tensor([3, 1, 4, 1], device=device),
                       (2 * torch.randn(B, K, V, generator=gen)).to(device),
                       torch.randint(0, V, (B, K - 1), generator=gen).to(device))


def _graph_step(x: GraphInputs, backend):
    """An engine's step with validate=False and tensor seeds: MRV2's call (packed, block,
    draft temperatures) and a padded slotted call with draft_probs."""
    packed = sk.verify_chain_packed(
        x.target, x.drafts, x.cu, max_draft_tokens=K, draft_logits=x.per_slot,
        draft_slots=x.slots, draft_temperature=x.draft_temperature,
        temperature=torch.where(x.draft_temperature == 0, 0.0, 1.0), seed=x.seeds,
        offset=x.seeds, method="block", backend=backend, validate=False)
    padded = sk.verify_chain(x.padded_target, x.padded_drafts,
                             draft_probs=torch.softmax(x.per_slot, -1), draft_slots=x.slots,
                             temperature=0.9, seed=x.seeds, offset=x.seeds, backend=backend,
                             validate=False)
    return (*packed[:2], *padded[:2])


GRAPH_BACKENDS = BACKENDS


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_slotted_step_compiles_fullgraph_and_reads_nothing_on_the_host(backend):
    torch._dynamo.reset()
    x = _graph_inputs()
    expected = _graph_step(x, backend)
    got = torch.compile(lambda x: _graph_step(x, backend), fullgraph=True,
                        backend="aot_eager")(x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    if backend != "triton":  # the guard checks the public layer, the same for Triton
        with forbid_host_sync():
            _graph_step(x, backend)


def _recorded_calls(backend):
    """(op, args) of every specdec op a slotted step dispatches, with the new arguments."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "specdec":
                calls.setdefault(func.name(), (func, tuple(
                    a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                    dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Record():
        _graph_step(_graph_inputs(), backend)
    return calls


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_opcheck_with_slots_and_draft_temperature(backend):
    calls = _recorded_calls(backend)
    chain_ops = [name for name in calls if "verify_chain" in name]
    assert len(chain_ops) == 2, calls.keys()
    for name in chain_ops:
        func, args, kwargs = calls[name]
        assert any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.dim() == 1
                   and torch.equal(a, torch.tensor([0.5, 0.0, 1.5, 1.0])) for a in args) or \
            "verify_chain_packed" not in name, name  # the draft temperature reached the op
        torch.library.opcheck(func, args, kwargs, test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor",
            "test_aot_dispatch_dynamic"))


def test_ops_carry_the_new_arguments():
    import inspect
    for name in ("reference_verify_chain", "reference_verify_chain_packed",
                 "triton_verify_chain", "triton_verify_chain_packed"):
        parameters = inspect.signature(_ops.IMPLEMENTATIONS[name]).parameters
        assert "draft_slots" in parameters and "draft_temperature" in parameters, name
        schema = str(getattr(torch.ops.specdec, name).default._schema)
        assert "Tensor? draft_slots" in schema and "Tensor? draft_temperature" in schema
    if _cpu.AVAILABLE:
        for name in ("cpu_verify_chain", "cpu_verify_chain_packed"):
            schema = str(getattr(torch.ops.specdec, name).default._schema)
            assert "Tensor? draft_slots=None" in schema, schema


# --------------------------------------------------------------------------------- MRV2 adapter

def test_mrv2_adapter_hands_the_engines_draft_tensor_to_the_op(monkeypatch):
    """No gathered copy: the op receives vLLM's own ``draft_logits`` ``[max_num_reqs, K, V]``
    (the same tensor object), ``idx_mapping`` as the slots and the requests' temperatures."""
    from specdec_kernels.adapters import vllm_mrv2

    seen = {}
    real = vllm_mrv2.verify_chain_packed

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(vllm_mrv2, "verify_chain_packed", spy)
    gen = torch.Generator().manual_seed(31)
    max_num_reqs, steps, vocab = 5, 3, 11
    counts = [3, 1, 2]
    num_reqs = len(counts)
    cu = torch.tensor([0] + list(torch.tensor(counts) + 1)).cumsum(0)
    num_logits = int(cu[-1])
    draft_logits = torch.randn(max_num_reqs, steps, vocab + 2, generator=gen)
    idx_mapping = torch.tensor([4, 0, 2], dtype=torch.int32)
    temperature = torch.tensor([0.9, 0.0, 1.3, 1.0, 0.6])
    sampled, num_sampled = vllm_mrv2.rejection_sample(
        torch.randn(num_logits, vocab, generator=gen), draft_logits,
        torch.randint(0, vocab, (num_logits,), generator=gen), cu.to(torch.int32),
        torch.arange(num_logits), idx_mapping, torch.zeros(num_logits, dtype=torch.int32),
        torch.zeros(num_logits, dtype=torch.int32), temperature,
        torch.arange(max_num_reqs), steps, backend="reference")
    assert seen["draft_logits"] is draft_logits
    assert seen["draft_slots"] is idx_mapping
    assert torch.equal(seen["draft_temperature"], temperature[idx_mapping.long()])
    assert sampled.shape == (num_reqs, steps + 1) and num_sampled.shape == (num_reqs,)

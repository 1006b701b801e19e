"""vLLM 0.34.0 MRV2 adapter (``specdec_kernels.adapters.vllm.mrv2_0_34``) without vLLM: its
signature, the DraftLogitsCache read replicated and sharded, placeholder drafts, the block
method, token-for-token equality with ``verify_chain_packed``, and errors naming arguments.
vLLM's own tests of it run in ``make engine-tests`` (docs/engines.md)."""
import importlib
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.adapters.vllm import mrv2_0_34 as mrv2

# vLLM 0.34.0's rejection_sampler_utils.rejection_sample, read from its wheel.
VLLM_0_34_PARAMETERS = [
    ("target_logits", inspect.Parameter.empty), ("draft_logits_cache", inspect.Parameter.empty),
    ("draft_sampled", inspect.Parameter.empty), ("cu_num_logits", inspect.Parameter.empty),
    ("pos", inspect.Parameter.empty), ("idx_mapping", inspect.Parameter.empty),
    ("expanded_idx_mapping", inspect.Parameter.empty),
    ("expanded_local_pos", inspect.Parameter.empty), ("temperature", inspect.Parameter.empty),
    ("seed", inspect.Parameter.empty), ("num_speculative_steps", inspect.Parameter.empty),
    ("synthetic_conditional_rates", None), ("use_fp64", False),
    ("use_block_verification", False), ("contexts", None), ("watermarking", None),
    ("watermarking_skip_mask", None), ("watermark_key", None), ("fly_window_size", 0),
    ("fly_entropy_threshold", 0.3), ("fly_entropy_top_k", 3),
    ("skip_masked_vocab_blocks", False)]


def _vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _problem(num_drafts=(3, 0, 2, 1), vocab=11, temperature=(1.0, 0.7, 0.0, 1.3),
             max_num_reqs=6, seed=0, shuffle=True):
    """MRV2's inputs for requests with ``num_drafts`` drafts each; a replicated
    ``[max_num_reqs, K, V]`` cache with request i at slot ``idx_mapping[i]``."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, steps = len(num_drafts), max(num_drafts)
    counts = torch.tensor(num_drafts) + 1
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
    num_logits = int(cu[-1])
    slots = torch.randperm(max_num_reqs, generator=gen)[:num_reqs] if shuffle else \
        torch.arange(num_reqs)
    values = torch.randn(max_num_reqs, steps, vocab, generator=gen)
    target = torch.randn(num_logits, vocab, generator=gen) * 1.5
    draft_sampled = torch.randint(0, vocab, (num_logits,), generator=gen)
    temps = torch.zeros(max_num_reqs)
    temps[slots] = torch.tensor(temperature[:num_reqs])
    inputs = dict(
        target_logits=target, draft_logits_cache=SimpleNamespace(values=values,
                                                                 row_mapping=None),
        draft_sampled=draft_sampled, cu_num_logits=cu,
        pos=torch.arange(num_logits, dtype=torch.int64) + 40,
        idx_mapping=slots.int(), expanded_idx_mapping=torch.repeat_interleave(slots, counts).int(),
        expanded_local_pos=torch.cat([torch.arange(int(c)) for c in counts]).int(),
        temperature=temps, seed=torch.randint(0, 2**40, (max_num_reqs,), generator=gen),
        num_speculative_steps=steps)
    return inputs


def _expected(inputs, method="token", draft_ids=None):
    """``verify_chain_packed`` called directly on the same rows (the drafter's rows gathered:
    the definition), the same seeds and offsets."""
    cu = inputs["cu_num_logits"].long()
    num_reqs = cu.shape[0] - 1
    slots = inputs["idx_mapping"].long()
    counts = cu[1:] - cu[:-1] - 1
    cu_drafts = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    rows = torch.cat([torch.arange(int(cu[i]) + 1, int(cu[i + 1])) for i in range(num_reqs)])
    if draft_ids is None:
        draft_ids = inputs["draft_sampled"][rows]
    values = inputs["draft_logits_cache"].values
    draft_logits = torch.cat([values[slots[i], :int(counts[i])] for i in range(num_reqs)])
    temp = inputs["temperature"][slots]
    out = sk.verify_chain_packed(
        inputs["target_logits"], draft_ids, cu_drafts,
        max_draft_tokens=inputs["num_speculative_steps"], draft_logits=draft_logits,
        draft_temperature=temp, temperature=torch.where(temp == 0, 0.0, 1.0),
        seed=inputs["seed"][slots], offset=inputs["pos"][cu[:-1]], method=method)
    return out.output_token_ids.long(), out.num_accepted + 1


def test_signature_is_vllm_0_34s():
    params = list(inspect.signature(mrv2.rejection_sample).parameters.values())
    ours = [(p.name, p.default) for p in params if p.kind != p.KEYWORD_ONLY]
    assert ours == VLLM_0_34_PARAMETERS
    assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["backend", "validate"]


def test_import_does_not_import_vllm():
    """Importing the adapter (and reading RejectionSampler without vLLM) imports no vLLM."""
    code = ("import sys; from specdec_kernels.adapters.vllm import mrv2_0_34 as m; "
            "m.rejection_sample; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("method", ["token", "block"])
def test_replicated_cache_equals_verify_chain_packed(method):
    inputs = _problem()
    sampled, num_sampled = mrv2.rejection_sample(
        **inputs, use_block_verification=method == "block")
    want, want_n = _expected(inputs, method)
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert sampled.shape == (4, inputs["num_speculative_steps"] + 1)
    assert torch.equal(num_sampled, want_n) and torch.equal(sampled, want)


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("method", ["token", "block"])
def test_sharded_cache_verifies_like_replicated(num_shards, method):
    """A rank's cache holds only the requests it verifies, at row_mapping's rows (batch
    position i at row i // num_shards of shard i % num_shards, as vLLM assigns them)."""
    inputs = _problem(num_drafts=(3, 1, 2, 3, 0, 2), temperature=(1.0, 0.8, 0.0, 1.2, 1.0, 0.9),
                      max_num_reqs=9, seed=3)
    block = method == "block"
    sampled, num_sampled = mrv2.rejection_sample(**inputs, use_block_verification=block)
    values, slots = inputs["draft_logits_cache"].values, inputs["idx_mapping"].long()
    cu = inputs["cu_num_logits"].long()
    for shard in range(num_shards):
        owned = torch.arange(shard, slots.shape[0], num_shards)
        row_mapping = torch.full((values.shape[0],), -1, dtype=torch.int32)
        row_mapping[slots[owned]] = torch.arange(owned.shape[0], dtype=torch.int32)
        local_values = torch.full((owned.shape[0], *values.shape[1:]), float("nan"))
        local_values[:] = values[slots[owned]]
        rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in owned.tolist()])
        local = dict(inputs, draft_logits_cache=SimpleNamespace(values=local_values,
                                                                row_mapping=row_mapping),
                     idx_mapping=inputs["idx_mapping"][owned],
                     cu_num_logits=torch.nn.functional.pad(
                         (cu[owned + 1] - cu[owned]).cumsum(0), (1, 0)).int())
        for name in ("target_logits", "draft_sampled", "pos", "expanded_idx_mapping",
                     "expanded_local_pos"):
            local[name] = inputs[name][rows]
        got, got_n = mrv2.rejection_sample(**local, use_block_verification=block)
        assert torch.equal(got_n, num_sampled[owned])
        assert torch.equal(got, sampled[owned])


def test_a_request_without_a_row_on_this_rank_samples_the_target():
    """row_mapping -1: the drafter's q is unknown here, so every draft is rejected and the
    token is the target's (a point mass here), whatever the drafts were."""
    inputs = _problem(num_drafts=(2, 2), temperature=(1.0, 1.0), max_num_reqs=2,
                      shuffle=False)
    inputs["target_logits"][:] = -30.0
    inputs["target_logits"][:, 4] = 30.0  # every row says token 4
    inputs["draft_sampled"][:] = 4  # drafts the target would accept
    values = inputs["draft_logits_cache"].values
    inputs["draft_logits_cache"] = SimpleNamespace(
        values=values[:1].clone(), row_mapping=torch.tensor([0, -1], dtype=torch.int32))
    sampled, num_sampled = mrv2.rejection_sample(**inputs)
    assert num_sampled[1] == 1 and sampled[1, 0] == 4
    assert num_sampled[0] >= 1


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("cached", [True, False])
def test_placeholders_end_verification(method, cached):
    """A -1 draft is rejected and nothing at or after it is accepted (drafts equal to the
    target's point mass after it included); the token there is sampled from the target."""
    inputs = _problem(num_drafts=(3, 3, 3), temperature=(1.0, 0.0, 0.6), max_num_reqs=3,
                      shuffle=False)
    inputs["target_logits"][:] = -30.0
    inputs["target_logits"][:, 5] = 30.0
    inputs["draft_sampled"][:] = 5
    inputs["draft_sampled"].view(3, 4)[:, 2] = -1  # the second draft of each request
    if cached:
        inputs["draft_logits_cache"].values[:] = inputs["target_logits"][0]
    else:
        inputs["draft_logits_cache"] = None
    sampled, num_sampled = mrv2.rejection_sample(
        **inputs, use_block_verification=method == "block")
    assert num_sampled.tolist() == [2, 2, 2]
    assert sampled[:, :2].eq(5).all() and sampled[:, 2:].eq(-1).all()


@pytest.mark.parametrize("fill", [float("nan"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_without_mass_emits_token_0_as_vllm(fill, temperature):
    """vLLM never emits -1 as a token: where our kernels emit -1 (no finite logit), the
    adapter writes vLLM's token 0 (its argmax over all -inf); other slots keep -1 padding."""
    inputs = _problem(num_drafts=(1, 2), temperature=(temperature, temperature),
                      max_num_reqs=2, shuffle=False)
    inputs["target_logits"][:] = fill
    sampled, num_sampled = mrv2.rejection_sample(**inputs)
    emitted = torch.arange(3) < num_sampled[:, None]
    assert (num_sampled >= 1).all()
    assert sampled[emitted].eq(0).all() and sampled[~emitted].eq(-1).all()


def test_one_hot_drafts_without_a_cache():
    inputs = _problem()
    inputs["draft_logits_cache"] = None
    cu = inputs["cu_num_logits"].long()
    sampled, num_sampled = mrv2.rejection_sample(**inputs)
    counts = cu[1:] - cu[:-1] - 1
    cu_drafts = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    rows = torch.cat([torch.arange(int(cu[i]) + 1, int(cu[i + 1])) for i in range(4)])
    slots = inputs["idx_mapping"].long()
    temp = inputs["temperature"][slots]
    want = sk.verify_chain_packed(
        inputs["target_logits"], inputs["draft_sampled"][rows], cu_drafts,
        max_draft_tokens=3, temperature=torch.where(temp == 0, 0.0, 1.0),
        seed=inputs["seed"][slots], offset=inputs["pos"][cu[:-1]])
    assert torch.equal(sampled, want.output_token_ids.long())
    assert torch.equal(num_sampled, want.num_accepted + 1)


def test_a_smaller_draft_vocabulary_verifies_over_its_tokens():
    """A padded target head (V + 3 columns, the drafter's V): as vLLM, the first V tokens."""
    inputs = _problem()
    vocab = inputs["target_logits"].shape[1]
    padded = torch.full((inputs["target_logits"].shape[0], vocab + 3), 50.0)
    padded[:, :vocab] = inputs["target_logits"]
    sampled, num_sampled = mrv2.rejection_sample(**dict(inputs, target_logits=padded))
    want, want_n = mrv2.rejection_sample(**inputs)
    assert torch.equal(sampled, want) and torch.equal(num_sampled, want_n)


def test_non_contiguous_rows_and_the_hints_change_nothing():
    inputs = _problem()
    want, want_n = mrv2.rejection_sample(**inputs)
    wide = torch.empty(inputs["target_logits"].shape[0], 20)
    wide[:, :11] = inputs["target_logits"]
    got, got_n = mrv2.rejection_sample(**dict(inputs, target_logits=wide[:, :11]),
                                       use_fp64=True, skip_masked_vocab_blocks=True)
    assert torch.equal(got, want) and torch.equal(got_n, want_n)
    # a bare [rows, K, V] tensor is a replicated cache
    got, got_n = mrv2.rejection_sample(
        **dict(inputs, draft_logits_cache=inputs["draft_logits_cache"].values))
    assert torch.equal(got, want) and torch.equal(got_n, want_n)


def test_chunks_equal_the_full_batch():
    """MRV2 verifies in request chunks: per-request seeds and positions key each request."""
    inputs = _problem(seed=5)
    full, full_n = mrv2.rejection_sample(**inputs)
    cu = inputs["cu_num_logits"].long()
    for start, end in ((0, 1), (1, 4)):
        lo, hi = int(cu[start]), int(cu[end])
        chunk = dict(inputs, cu_num_logits=(cu[start:end + 1] - lo).int(),
                     idx_mapping=inputs["idx_mapping"][start:end])
        for name in ("target_logits", "draft_sampled", "pos", "expanded_idx_mapping",
                     "expanded_local_pos"):
            chunk[name] = inputs[name][lo:hi]
        got, got_n = mrv2.rejection_sample(**chunk)
        assert torch.equal(got_n, full_n[start:end]) and torch.equal(got, full[start:end])


@pytest.mark.parametrize("change, name, error", [
    (dict(draft_logits_cache=object()), "draft_logits_cache", TypeError),
    (dict(draft_logits_cache=SimpleNamespace(values=torch.zeros(6, 3), row_mapping=None)),
     "draft_logits_cache.values", ValueError),
    (dict(draft_logits_cache=SimpleNamespace(values=torch.zeros(6, 2, 11),
                                             row_mapping=None)),
     "draft_logits_cache.values", ValueError),
    (dict(draft_logits_cache=SimpleNamespace(values=torch.zeros(6, 3, 11),
                                             row_mapping=torch.zeros(6))),
     "draft_logits_cache.row_mapping", TypeError),
    (dict(pos=torch.arange(3)), "pos", ValueError),
    (dict(expanded_local_pos=torch.arange(3)), "expanded_local_pos", ValueError),
    (dict(expanded_idx_mapping=torch.zeros(10)), "expanded_idx_mapping", TypeError),
    (dict(idx_mapping=torch.arange(3)), "idx_mapping", ValueError),
    (dict(num_speculative_steps=True), "num_speculative_steps", TypeError),
    (dict(use_fp64="yes"), "use_fp64", TypeError),
    (dict(skip_masked_vocab_blocks=1), "skip_masked_vocab_blocks", TypeError),
    (dict(idx_mapping=torch.tensor([0, 1, 2, 6], dtype=torch.int32)), "idx_mapping", ValueError),
    (dict(cu_num_logits=torch.tensor([0, 4, 5, 8, 9], dtype=torch.int32)), "cu_num_logits",
     ValueError),
    (dict(draft_logits_cache=SimpleNamespace(values=torch.zeros(2, 3, 11), row_mapping=torch.tensor(
        [0, 1, 2, 0, 1, 2], dtype=torch.int32))), "draft_logits_cache.row_mapping", ValueError),
    (dict(target_logits=torch.zeros(3, 11), draft_sampled=torch.zeros(3, dtype=torch.int64),
          pos=torch.arange(3), expanded_idx_mapping=torch.zeros(3, dtype=torch.int64),
          expanded_local_pos=torch.zeros(3, dtype=torch.int64)), "target_logits", ValueError),
    (dict(validate="yes"), "validate", TypeError),
])
def test_bad_input_names_the_argument(change, name, error):
    inputs = _problem()
    with pytest.raises(error, match=name.replace(".", r"\.")):
        mrv2.rejection_sample(**dict(inputs, **change))


def test_unvalidated_slots_are_clamped_never_read_out_of_bounds():
    inputs = _problem()
    sampled, num_sampled = mrv2.rejection_sample(
        **dict(inputs, idx_mapping=torch.tensor([0, 1, 2, 60], dtype=torch.int32)),
        validate=False)
    assert ((sampled >= -1) & (sampled < 11)).all() and (num_sampled >= 1).all()


@pytest.mark.parametrize("mode, name", [
    (dict(synthetic_conditional_rates=torch.ones(3)), "synthetic_conditional_rates"),
    (dict(fly_window_size=2), "fly_window_size"),
    (dict(contexts=torch.zeros(10, 2, dtype=torch.int64), watermarking=torch.ones(6).bool(),
          watermark_key=42), "contexts"),
])
def test_vllm_only_modes_without_vllm_name_the_argument(mode, name):
    if _vllm_importable():
        pytest.skip("vLLM is installed here: the mode is delegated to it")
    with pytest.raises(NotImplementedError, match=name):
        mrv2.rejection_sample(**dict(_problem(), **mode))


def test_rejection_sampler_without_vllm_names_sampler():
    if _vllm_importable():
        pytest.skip("vLLM is installed here")
    with pytest.raises(NotImplementedError, match="sampler"):
        mrv2.RejectionSampler(None, SimpleNamespace(), torch.device("cpu"))


def test_verify_is_vllms_step_with_our_rejection_sample():
    """``_verify`` (installed on vLLM's class) with a stand-in sampler: vLLM's sampling
    parameters first, then our rejection_sample on the processed rows."""
    inputs = _problem()
    calls = []

    def apply_sampling_params(logits, *args):
        calls.append(len(args))
        return logits * 1.0

    sampler = SimpleNamespace(
        apply_sampling_params=apply_sampling_params, use_fp64_gumbel=False,
        sampling_states=SimpleNamespace(temperature=SimpleNamespace(gpu=inputs["temperature"]),
                                        seeds=SimpleNamespace(gpu=inputs["seed"])),
        trace_replay_state=None, may_mask_logits=torch.zeros(6, dtype=torch.bool).numpy())
    this = SimpleNamespace(sampler=sampler, num_speculative_steps=3,
                           synthetic_conditional_rates=None, use_block_verification=False,
                           fly_window_size=0, fly_entropy_threshold=0.3, fly_entropy_top_k=3,
                           _watermarking_kwargs=lambda *args: {})
    processed, sampled, num_sampled = mrv2._verify(
        this, inputs["target_logits"], inputs["draft_logits_cache"], inputs["draft_sampled"],
        inputs["pos"], inputs["cu_num_logits"], inputs["idx_mapping"],
        inputs["idx_mapping"].numpy(), inputs["expanded_idx_mapping"],
        inputs["expanded_local_pos"], None)
    want, want_n = mrv2.rejection_sample(**inputs)
    assert calls == [7] and torch.equal(processed, inputs["target_logits"])
    assert torch.equal(sampled, want) and torch.equal(num_sampled, want_n)

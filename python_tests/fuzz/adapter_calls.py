"""Fuzz strategies for the engine adapters (issue 47's surfaces): a valid call of each adapter
in its engine's layout, and a table of ways to break one argument, each with the exception it
must raise and the argument its message must start with.

* ``vllm``: vLLM 0.33's V1 step -- ``RejectionSampler`` with a Sampler that draws from torch's
  and the requests' generators (as vLLM's does), the fused class, and ``rejection_sample``;
  every draft-row feature (penalties, bad words, allowed ids, logit bias, min tokens), ``-1``
  drafts, ``draft_probs``, a grammar bitmask, explicit or drawn seeds.
* ``mrv2``: vLLM 0.33's MRV2 ``rejection_sample`` (value checks on: CPU tensors, eager).
* ``sglang``: ``tree_speculative_sampling_target_only`` at batch sizes 0..2.
* ``flashinfer``: ``chain_speculative_sampling`` at batch sizes 0..2.

A call is a dict of arguments; ``CALLS[surface]`` holds its strategy, its table of mutations
and the function that makes the call. A mutation replaces arguments (never writes into a
tensor), so every tensor the call sees can be compared before and after; it returns False
where it does not apply to the drawn call.
"""
from __future__ import annotations

import dataclasses
import math
import types

import torch
from hypothesis import strategies as st

from specdec_kernels.adapters import flashinfer, sglang, vllm, vllm_mrv2

SURFACES = ("vllm", "mrv2", "sglang", "flashinfer")


class DrawingSampler:
    """vLLM's ``Sampler`` as the rejection sampler calls it, drawing from torch's generator
    and each request's (vLLM's does): a rejected call must not have reached it."""

    logprobs_mode = "raw_logprobs"

    def __init__(self):
        self.calls = 0

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False,
                 logprobs_mode_override=None):
        self.calls += 1
        torch.rand(1)
        for generator in sampling_metadata.generators.values():
            torch.rand(1, generator=generator)
        return vllm.SamplerOutput(logits.argmax(-1).int()[:, None], None)


def _generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


# --------------------------------------------------------------------------------------------
# vLLM V1

@st.composite
def vllm_call(draw):
    gen = _generator(draw)
    batch, vocab = draw(st.integers(1, 4)), draw(st.integers(2, 40))
    drafts = [draw(st.lists(st.integers(-1, vocab - 1), max_size=3)) for _ in range(batch)]
    total = sum(map(len, drafts))
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(drafts)
    logits = torch.randn(total + batch, vocab, generator=gen) * 2
    draft_probs = torch.softmax(torch.randn(total, vocab, generator=gen), -1) \
        if draw(st.booleans()) else None
    sm = dict(temperature=torch.rand(batch, generator=gen) + 0.2, all_greedy=False,
              all_random=True, output_token_ids=[[int(t) for t in torch.randint(
                  0, vocab, (3,), generator=gen)] for _ in range(batch)],
              spec_token_ids=drafts, generators={0: _generator(draw)})
    if draw(st.booleans()):
        sm.update(top_k=torch.randint(0, vocab + 2, (batch,), generator=gen),
                  top_p=torch.rand(batch, generator=gen) * 0.9 + 0.1,
                  min_p=torch.rand(batch, generator=gen) * 0.2)
    if draw(st.booleans()):  # written first: a late check would leave it in logits
        mask = torch.rand(batch, vocab, generator=gen) < 0.3
        mask[:, 0] = False
        sm["allowed_token_ids_mask"] = mask
    if draw(st.booleans()):
        sm.update(no_penalties=False, prompt_token_ids=torch.randint(
            0, vocab + 1, (batch, 3), generator=gen),
            frequency_penalties=torch.rand(batch, generator=gen),
            presence_penalties=torch.rand(batch, generator=gen),
            repetition_penalties=torch.rand(batch, generator=gen) + 1)
    if draw(st.booleans()):
        sm["bad_words_token_ids"] = {0: [[draw(st.integers(0, vocab - 1))]]}
    processors = []
    if draw(st.booleans()):
        processors.append(types.SimpleNamespace(biases={0: {vocab - 1: 1.5}}))
    if draw(st.booleans()):
        processors.append(types.SimpleNamespace(min_toks={0: (9, [], {0})},
                                                apply_with_spec_decode=None))
    if processors:
        sm["logitsprocs"] = types.SimpleNamespace(argmax_invariant=[],
                                                  non_argmax_invariant=processors)
    keys = {}
    if draw(st.booleans()):
        keys = dict(seed=torch.randint(0, 2**40, (batch,), generator=gen), offset=3)
    if draw(st.booleans()):
        keys["token_bitmask"] = torch.full((total + batch, -(-vocab // 32)), -1,
                                           dtype=torch.int32)
    return dict(metadata=metadata, draft_probs=draft_probs, logits=logits, sm=sm, keys=keys,
                mode=draw(st.sampled_from(["sampler", "fused", "function"])), batch=batch,
                vocab=vocab)


def _features(sm, **processors):
    return types.SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[
        types.SimpleNamespace(apply_with_spec_decode=None, **processors)
        if "min_toks" in processors else types.SimpleNamespace(**processors)])


def _penalised(sm, batch, **changes):
    sm.update(no_penalties=False, prompt_token_ids=torch.zeros(batch, 1, dtype=torch.int64),
              frequency_penalties=torch.ones(batch), presence_penalties=torch.ones(batch),
              repetition_penalties=torch.ones(batch))
    sm.update(changes)


def vllm_mutations(c):
    """name -> (exception, the argument named, mutate(call)) for a drawn vLLM call."""
    b, v, sm, keys = c["batch"], c["vocab"], c["sm"], c["keys"]
    md = c["metadata"]
    return {
        "top_k float": (TypeError, "top_k", lambda: sm.update(top_k=torch.ones(b))),
        "temperature bool": (TypeError, "temperature", lambda: sm.update(
            temperature=torch.ones(b, dtype=torch.bool))),
        "top_p bool": (TypeError, "top_p", lambda: sm.update(top_p=torch.ones(b) > 0)),
        "min_p short": (ValueError, "min_p", lambda: sm.update(min_p=torch.zeros(b - 1))),
        "temperature missing": (ValueError, "temperature", lambda: sm.update(temperature=None)),
        "seed 1.5": (TypeError, "seed", lambda: keys.update(seed=1.5)),
        "seed shape": (ValueError, "seed", lambda: keys.update(
            seed=torch.zeros(b + 1, dtype=torch.int64))),
        "offset shape": (ValueError, "offset", lambda: keys.update(
            offset=torch.zeros(b, 2, dtype=torch.int64))),
        "offset 2**64": (ValueError, "offset", lambda: keys.update(offset=2**64)),
        "bad word past V": (ValueError, "bad_words_token_ids", lambda: sm.update(
            bad_words_token_ids={0: [[v + 1]]})),
        "bad word negative": (ValueError, "bad_words_token_ids", lambda: sm.update(
            bad_words_token_ids={b - 1: [[0, -1 - v // 2]]})),
        "bad word empty": (ValueError, "bad_words_token_ids", lambda: sm.update(
            bad_words_token_ids={0: [[]]})),
        "logit bias past V": (ValueError, "logit_bias", lambda: sm.update(
            logitsprocs=_features(sm, biases={0: {0: 1.0, v: 2.0}}))),
        "logit bias not a number": (TypeError, "logit_bias", lambda: sm.update(
            logitsprocs=_features(sm, biases={0: {0: "big"}}))),
        "min tokens past V": (ValueError, "min_tokens", lambda: sm.update(
            logitsprocs=_features(sm, min_toks={0: (9, [], {0, v})}))),
        "min tokens negative": (ValueError, "min_tokens", lambda: sm.update(
            logitsprocs=_features(sm, min_toks={0: (9, [], {-1})}))),
        "min tokens entry": (TypeError, "min_tokens", lambda: sm.update(
            logitsprocs=_features(sm, min_toks={0: (9, 3, {0})}))),
        "logit bias not a dict": (TypeError, "logit_bias", lambda: sm.update(
            logitsprocs=_features(sm, biases={0: [1.0]}))),
        "bad words not a list": (TypeError, "bad_words_token_ids", lambda: sm.update(
            bad_words_token_ids={0: 3})),
        "prompt 1-D": (ValueError, "prompt_token_ids", lambda: _penalised(
            sm, b, prompt_token_ids=torch.zeros(3, dtype=torch.int64))),
        "prompt float": (TypeError, "prompt_token_ids", lambda: _penalised(
            sm, b, prompt_token_ids=torch.zeros(b, 3))),
        "penalties bool": (TypeError, "presence_penalties", lambda: _penalised(
            sm, b, presence_penalties=torch.ones(b, dtype=torch.bool))),
        "history past V": (ValueError, "output_token_ids", lambda: _penalised(
            sm, b, output_token_ids=[[v]] + [[]] * (b - 1))),
        "allowed mask shape": (ValueError, "allowed_token_ids_mask", lambda: sm.update(
            allowed_token_ids_mask=torch.zeros(b, v + 1, dtype=torch.bool))),
        "generators index": (ValueError, "generators", lambda: sm.update(
            generators={b: torch.Generator()})),
        "max_num_logprobs": (ValueError, "max_num_logprobs", lambda: sm.update(
            max_num_logprobs=v + 1)),
        "draft_probs shape": (ValueError, "draft_probs", lambda: c.update(
            draft_probs=torch.full((md.draft_token_ids.shape[0] + 1, v), 1.0 / v))),
        "bitmask width": (ValueError, "token_bitmask", lambda: keys.update(
            token_bitmask=torch.full((c["logits"].shape[0], -(-v // 32) + 1), -1,
                                     dtype=torch.int32))),
        "num_draft_tokens": (ValueError, "num_draft_tokens", lambda: c.update(
            metadata=dataclasses.replace(md, num_draft_tokens=[-1] + md.num_draft_tokens[1:]))),
        "logits V = 0": (ValueError, "logits", lambda: c.update(
            logits=c["logits"][:, :0], draft_probs=None, keys={}, sm=dict(
                temperature=torch.ones(b), all_greedy=False, all_random=True))),
        "backend": (ValueError, "backend", lambda: c.update(backend="bogus")),
    }


def run_vllm(c):
    sm = vllm.SamplingMetadata(**c["sm"])
    backend = c.get("backend", "auto")
    if c["mode"] == "function":
        return vllm.rejection_sample(c["metadata"], c["draft_probs"], c["logits"], sm,
                                     backend=backend, **c["keys"])
    sampler = c.setdefault("sampler", DrawingSampler())
    return vllm.RejectionSampler(sampler, fused_bonus=c["mode"] == "fused", backend=backend)(
        c["metadata"], c["draft_probs"], c["logits"], sm, **c["keys"])


# --------------------------------------------------------------------------------------------
# vLLM MRV2

@st.composite
def mrv2_call(draw):
    gen = _generator(draw)
    drafts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    vocab, slots = draw(st.integers(2, 30)), len(drafts) + draw(st.integers(0, 2))
    steps = max(drafts)
    counts = torch.tensor(drafts) + 1
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
    rows = int(cu[-1])
    idx = torch.randperm(slots, generator=gen)[:len(drafts)].int()
    return dict(target_logits=torch.randn(rows, vocab, generator=gen),
                draft_logits=torch.randn(slots, max(steps, 1), vocab, generator=gen)
                if draw(st.booleans()) else None,
                draft_sampled=torch.randint(-1, vocab, (rows,), generator=gen),
                cu_num_logits=cu, pos=torch.arange(rows), idx_mapping=idx,
                expanded_idx_mapping=torch.repeat_interleave(idx, counts),
                expanded_local_pos=torch.cat([torch.arange(int(n)) for n in counts]).int(),
                temperature=torch.rand(slots, generator=gen),
                seed=torch.randint(0, 2**40, (slots,), generator=gen),
                num_speculative_steps=steps)


def mrv2_mutations(c):
    reqs, slots = c["idx_mapping"].shape[0], c["temperature"].shape[0]

    def past_end():
        idx = c["idx_mapping"].clone()
        idx[-1] = slots
        c["idx_mapping"] = idx

    def fewer_rows():
        keep = reqs - 1
        c.update(target_logits=c["target_logits"][:keep], draft_sampled=c["draft_sampled"][:keep],
                 pos=c["pos"][:keep])
    out = {
        "idx_mapping past the end": (ValueError, "idx_mapping", past_end),
        "fewer rows than requests": (ValueError, "target_logits", fewer_rows),
        "cu_num_logits end": (ValueError, "cu_num_logits", lambda: c.update(
            cu_num_logits=torch.cat([c["cu_num_logits"][:-1], c["cu_num_logits"][-1:] - 1]))),
        "draft_sampled length": (ValueError, "draft_sampled", lambda: c.update(
            draft_sampled=c["draft_sampled"][:-1])),
        "num_speculative_steps bool": (TypeError, "num_speculative_steps", lambda: c.update(
            num_speculative_steps=True)),
        "temperature 2-D": (ValueError, "temperature", lambda: c.update(
            temperature=c["temperature"][None])),
    }
    cut = int(c["idx_mapping"].max())  # the slots up to the last one used: one too few

    def short(name):
        def mutate():
            if not cut or c[name] is None:
                return False  # not applicable to this call: every slot it has is used
            c[name] = c[name][:cut]
        return mutate
    out["temperature short"] = (ValueError, "idx_mapping", short("temperature"))
    out["seed short"] = (ValueError, "idx_mapping", short("seed"))
    out["draft_logits short"] = (ValueError, "idx_mapping", short("draft_logits"))
    return out


def run_mrv2(c):
    return vllm_mrv2.rejection_sample(**c)


# --------------------------------------------------------------------------------------------
# SGLang and FlashInfer

@st.composite
def sglang_call(draw):
    gen = _generator(draw)
    batch, nodes, vocab = draw(st.integers(0, 2)), draw(st.integers(1, 5)), draw(
        st.integers(2, 12))
    parents = torch.tensor([[-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)]]
                           ).expand(batch, nodes)
    tree = sglang.tree_to_sglang(parents, torch.randint(0, vocab, (batch, nodes), generator=gen))
    call = dict(predicts=torch.full((max(batch * nodes, 1),), -1, dtype=torch.int32),
                accept_index=torch.full((batch, nodes), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(batch, dtype=torch.int32),
                candidates=tree.candidates, retrive_index=tree.retrive_index,
                retrive_next_token=tree.retrive_next_token,
                retrive_next_sibling=tree.retrive_next_sibling)
    if draw(st.booleans()):
        call["target_probs"] = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    else:
        call.update(target_logits=torch.randn(batch, nodes, vocab, generator=gen),
                    temperature=torch.rand(batch, 1, generator=gen) + 0.1)
    if draw(st.booleans()):
        call["draft_probs"] = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    return call


def sglang_mutations(c):
    b, n = c["candidates"].shape
    logits = c.get("target_logits")
    v = (logits if logits is not None else c["target_probs"]).shape[-1]

    def filters(**changes):
        c.pop("target_probs", None)
        c.pop("temperature", None)
        c.setdefault("target_logits", torch.zeros(b, n, v))
        c.update(changes)
    return {
        "temperature -1": (ValueError, "temperature", lambda: filters(temperature=-1.0)),
        "temperature nan": (ValueError, "temperature", lambda: filters(temperature=math.nan)),
        "top_k -1": (ValueError, "top_k", lambda: filters(top_k=-1)),
        "temperatures [bs + 1, 1]": (ValueError, "temperature", lambda: filters(
            temperature=torch.ones(b + 1, 1))),
        "draft_sampling": (ValueError, "draft_sampling", lambda: c.update(
            draft_sampling="bogus")),
        "seed 1.5": (TypeError, "seed", lambda: c.update(seed=1.5)),
        "backend": (ValueError, "backend", lambda: c.update(backend="bogus")),
        "draft_probs int": (TypeError, "draft_probs", lambda: c.update(
            draft_probs=torch.ones(b, n, v, dtype=torch.int64))),
        "threshold_single": (ValueError, "threshold_single", lambda: c.update(
            threshold_single=1.5)),
        "deterministic": (TypeError, "deterministic", lambda: c.update(deterministic="yes")),
        "accept_index dtype": (TypeError, "accept_index", lambda: c.update(
            accept_index=c["accept_index"].long())),
        "target_probs V = 0": (ValueError, "target_probs", lambda: c.update(
            target_probs=torch.zeros(b, n, 0), target_logits=None, temperature=None,
            draft_probs=None)),
    }


def run_sglang(c):
    return sglang.tree_speculative_sampling_target_only(**c)


@st.composite
def flashinfer_call(draw):
    gen = _generator(draw)
    batch, drafts, vocab = draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(
        st.integers(2, 12))
    call = dict(draft_probs=torch.softmax(torch.randn(batch, drafts, vocab, generator=gen), -1),
                draft_token_ids=torch.randint(0, vocab, (batch, drafts), generator=gen),
                target_probs=torch.softmax(torch.randn(batch, drafts + 1, vocab,
                                                       generator=gen), -1))
    if draw(st.booleans()):
        call.update(maybe_output_accepted_token_num=torch.zeros(batch, dtype=torch.int32),
                    maybe_output_emitted_draft_token_num=torch.zeros(batch, dtype=torch.int32))
    if draw(st.booleans()):
        call["generator"] = _generator(draw)
    return call


def flashinfer_mutations(c):
    b, k, v = c["draft_probs"].shape
    return {
        "V = 0": (ValueError, "target_probs, draft_probs", lambda: c.update(
            draft_probs=c["draft_probs"][..., :0], target_probs=c["target_probs"][..., :0])),
        "target_probs rows": (ValueError, "target_probs", lambda: c.update(
            target_probs=c["target_probs"][:, :k])),
        "target_probs int": (TypeError, "target_probs", lambda: c.update(
            target_probs=c["target_probs"].long())),
        "counter dtype": (TypeError, "maybe_output_accepted_token_num", lambda: c.update(
            maybe_output_accepted_token_num=torch.zeros(b))),
        "generator": (TypeError, "generator", lambda: c.update(generator=3)),
        "seed shape": (ValueError, "seed", lambda: c.update(
            seed=torch.zeros(b + 2, dtype=torch.int64), offset=0)),
        "deterministic": (TypeError, "deterministic", lambda: c.update(deterministic="yes")),
    }


def run_flashinfer(c):
    return flashinfer.chain_speculative_sampling(**c)


CALLS = {"vllm": (vllm_call, vllm_mutations, run_vllm),
         "mrv2": (mrv2_call, mrv2_mutations, run_mrv2),
         "sglang": (sglang_call, sglang_mutations, run_sglang),
         "flashinfer": (flashinfer_call, flashinfer_mutations, run_flashinfer)}

# Every mutation's name, per surface (the test is parametrised by them; it checks that each
# table has exactly these).
MUTATION_NAMES = {
    "vllm": ("top_k float", "temperature bool", "top_p bool", "min_p short",
             "temperature missing", "seed 1.5", "seed shape", "offset shape", "offset 2**64",
             "bad word past V", "bad word negative", "bad word empty", "logit bias past V",
             "logit bias not a number", "min tokens past V", "min tokens negative",
             "min tokens entry", "logit bias not a dict", "bad words not a list",
             "prompt 1-D", "prompt float", "penalties bool", "history past V",
             "allowed mask shape", "generators index", "max_num_logprobs", "draft_probs shape",
             "bitmask width", "num_draft_tokens", "logits V = 0", "backend"),
    "mrv2": ("idx_mapping past the end", "fewer rows than requests", "cu_num_logits end",
             "draft_sampled length", "num_speculative_steps bool", "temperature 2-D",
             "temperature short", "seed short", "draft_logits short"),
    "sglang": ("temperature -1", "temperature nan", "top_k -1", "temperatures [bs + 1, 1]",
               "draft_sampling", "seed 1.5", "backend", "draft_probs int", "threshold_single",
               "deterministic", "accept_index dtype", "target_probs V = 0"),
    "flashinfer": ("V = 0", "target_probs rows", "target_probs int", "counter dtype",
                   "generator", "seed shape", "deterministic"),
}

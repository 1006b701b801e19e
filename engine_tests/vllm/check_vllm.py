"""vLLM 0.33.0's runner line and its own Sampler with our class swapped in (CPU, interpreter).

1. docs/engines.md's swap line, then ``GPUModelRunner``'s construction line
   ``RejectionSampler(self.sampler, self.speculative_config, self.device)`` with vLLM's own
   ``Sampler`` (the runner module itself when it imports on CPU).
2. ``forward`` on vLLM's runner layout with vLLM's ``SamplingMetadata`` / ``LogitsProcessors``
   and penalties: greedy tokens equal to vLLM's own ``RejectionSampler``; logprobs shapes.
Prints what ran; exits non-zero on a mismatch.
"""
import sys
import types

import torch

import vllm.v1.sample.rejection_sampler

vllm_class = vllm.v1.sample.rejection_sampler.RejectionSampler
from specdec_kernels.adapters import vllm as sk_vllm  # noqa: E402

vllm.v1.sample.rejection_sampler.RejectionSampler = sk_vllm.RejectionSampler  # docs/engines.md

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

failures = []
try:
    import vllm.v1.worker.gpu_model_runner as runner_module
    runner_class = runner_module.RejectionSampler
    print(f"gpu_model_runner imported: its RejectionSampler is "
          f"{runner_class.__module__}.{runner_class.__qualname__}")
    if runner_class is not sk_vllm.RejectionSampler:
        failures.append("the runner module does not see the swapped class")
except Exception as error:  # noqa: BLE001 -- report how far CPU gets
    runner_class = vllm.v1.sample.rejection_sampler.RejectionSampler
    print(f"gpu_model_runner does not import here ({type(error).__name__}: {error}); "
          f"using the swapped module attribute it imports")

spec_config = types.SimpleNamespace(rejection_sample_method="standard",
                                    num_speculative_tokens=3)
device = torch.device("cpu")
ours = runner_class(Sampler(), spec_config, device)  # GPUModelRunner's line
print(f"constructed: {type(ours).__module__}.{type(ours).__name__}")
theirs = vllm_class(Sampler(), spec_config, device)

drafts = [[1, 2, 3], [], [4, 5], [6]]
num_drafts = [len(d) for d in drafts]
batch, vocab, total = len(drafts), 32, sum(num_drafts)
layout = sk_vllm.SpecDecodeMetadata.from_draft_token_ids(drafts)
metadata = SpecDecodeMetadata(
    draft_token_ids=layout.draft_token_ids, num_draft_tokens=num_drafts,
    cu_num_draft_tokens=layout.cu_num_draft_tokens,
    cu_num_sampled_tokens=layout.cu_num_sampled_tokens,
    target_logits_indices=layout.target_logits_indices,
    bonus_logits_indices=layout.bonus_logits_indices, logits_indices=layout.logits_indices)
gen = torch.Generator().manual_seed(0)
logits = torch.randn(total + batch, vocab, generator=gen)
for b, d in enumerate(drafts):  # make most drafts the arg-max
    start = sum(num_drafts[:b]) + b
    for j, token in enumerate(d):
        logits[start + j, token] += 6.0 if (b + j) % 3 != 2 else 0.0


def sampling(max_num_logprobs=None):
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=max_num_logprobs, no_penalties=False,
        prompt_token_ids=torch.tensor([[7, 8, vocab]] * batch),
        frequency_penalties=torch.full((batch,), 0.5),
        presence_penalties=torch.full((batch,), 0.2),
        repetition_penalties=torch.full((batch,), 1.3),
        output_token_ids=[[2, 9]] * batch, spec_token_ids=drafts,
        allowed_token_ids_mask=None, bad_words_token_ids={0: [[1, 2]]},
        logitsprocs=LogitsProcessors())


# vLLM's Sampler picks torch.ops._C.greedy_argmax on its CPU platform, an op of vLLM's CPU
# build that the CUDA wheel lacks: use its other platforms' line (logits.argmax(-1)).
Sampler.greedy_sample = staticmethod(lambda logits: logits.argmax(dim=-1).view(-1))
try:
    want = theirs(metadata, None, logits.clone(), sampling()).sampled_token_ids
    got = ours(metadata, None, logits.clone(), sampling()).sampled_token_ids
    print(f"greedy with penalties and bad words: vLLM {want.tolist()}, ours {got.tolist()}")
    if not torch.equal(want, got):
        failures.append("greedy tokens differ from vLLM's own RejectionSampler")
    out = ours(metadata, None, logits.clone(), sampling(max_num_logprobs=2))
    lists, logprobs = sk_vllm.RejectionSampler.parse_output(
        out.sampled_token_ids, vocab, (), out.logprobs_tensors)
    print(f"logprobs: {type(out.logprobs_tensors).__module__}."
          f"{type(out.logprobs_tensors).__name__}, {len(logprobs.logprob_token_ids)} rows "
          f"for {sum(map(len, lists))} tokens")
except Exception as error:  # noqa: BLE001
    print(f"vLLM's own Sampler does not run here: {type(error).__name__}: {error}")


# --- MRV2: our rejection_sample against vLLM's own (its Triton kernels, interpreted on CPU)
from scipy import stats  # noqa: E402

from specdec_kernels.adapters import vllm_mrv2  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import \
    rejection_sample as vllm_mrv2_rejection_sample  # noqa: E402


def mrv2_inputs(num_reqs, vocab, steps, temperature, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.full((num_reqs,), steps + 1)
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
    num_logits = int(cu[-1])
    target_row = torch.randn(steps + 1, vocab, generator=gen) * 1.5
    draft_row = torch.randn(steps, vocab, generator=gen)
    draft_logits = draft_row.expand(num_reqs, steps, vocab).contiguous()
    t = torch.full((num_reqs,), float(temperature))
    target = (target_row / (temperature or 1.0)).repeat(num_reqs, 1)  # MRV2: processed rows
    draft_sampled = torch.zeros(num_logits, dtype=torch.int64)
    q = torch.softmax(draft_row / (temperature or 1.0), -1)
    for j in range(steps):
        draft_sampled.view(num_reqs, steps + 1)[:, j + 1] = torch.multinomial(
            q[j], num_reqs, replacement=True, generator=gen)
    return dict(target_logits=target, draft_logits=draft_logits, draft_sampled=draft_sampled,
                cu_num_logits=cu, pos=torch.arange(num_logits, dtype=torch.int64) + 7,
                idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
                expanded_idx_mapping=torch.repeat_interleave(torch.arange(num_reqs), counts).int(),
                expanded_local_pos=torch.arange(steps + 1).repeat(num_reqs).int(),
                temperature=t, seed=torch.randint(0, 2**40, (num_reqs,), generator=gen),
                num_speculative_steps=steps), torch.softmax(target_row[0] / (temperature or 1.0), -1)


try:
    inputs, _ = mrv2_inputs(24, 50, 3, 0.0)
    want, want_n = vllm_mrv2_rejection_sample(**inputs)
    got, got_n = vllm_mrv2.rejection_sample(**inputs)
    live = torch.arange(4)[None, :] < want_n[:, None]
    same = torch.equal(want_n, got_n) and torch.equal(want[live], got[live])
    print(f"MRV2 greedy, 24 requests x 3 drafts: tokens equal to vLLM's: {same}")
    if not same:
        failures.append("MRV2 greedy tokens differ from vLLM's")
    for method in (False, True):
        label = "block" if method else "token"
        inputs, law = mrv2_inputs(3000, 6, 1, 0.8, seed=1)
        for name, fn in (("vLLM's", vllm_mrv2_rejection_sample),
                         ("ours", vllm_mrv2.rejection_sample)):
            try:
                sampled, _ = fn(**inputs, use_block_verification=method)
            except Exception as error:  # noqa: BLE001
                print(f"MRV2 {label}, {name}: does not run here: {type(error).__name__}: "
                      f"{str(error)[:120]}")
                if name == "ours":
                    failures.append(f"MRV2 {label}: ours did not run")
                continue
            counts = torch.bincount(sampled[:, 0], minlength=6).double()
            expected = law.double() / law.double().sum() * counts.sum()
            pvalue = float(stats.chisquare(counts, expected).pvalue)
            print(f"MRV2 {label}, {name}: first emitted token vs softmax(target row 0), "
                  f"3000 requests: chi-square p = {pvalue:.3g}")
            if name == "ours" and pvalue < 1e-3:
                failures.append(f"MRV2 {label}: our law rejected (p = {pvalue:.3g})")
except Exception as error:  # noqa: BLE001
    print(f"MRV2 comparison did not run: {type(error).__name__}: {error}")
    failures.append("MRV2 comparison did not run")

# --- MRV2's class: docs/engines.md's swap line, then MRV2's construction
try:
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler as mrv2
    vllm_mrv2_class = mrv2.RejectionSampler
    mrv2.RejectionSampler = vllm_mrv2.RejectionSampler  # docs/engines.md
    mrv2_config = types.SimpleNamespace(
        num_speculative_tokens=3, enable_adaptive_verification=False,
        rejection_sample_method="block", fly_entropy_threshold=0.3, fly_entropy_top_k=3,
        fly_window_size=None, synthetic_acceptance_rates=None)
    built = mrv2.RejectionSampler(None, mrv2_config, device)
    ok = isinstance(built, vllm_mrv2_class) and type(built)._verify is not vllm_mrv2_class._verify
    print(f"MRV2 RejectionSampler(sampler, spec_config, device) after the swap: vLLM's class "
          f"with our _verify: {ok}, block verification: {built.use_block_verification}")
    if not ok:
        failures.append("MRV2 class construction")
except Exception as error:  # noqa: BLE001
    print(f"MRV2 class construction did not run: {type(error).__name__}: {error}")
    failures.append("MRV2 class construction")

print("FAILED: " + "; ".join(failures) if failures else "OK")
sys.exit(1 if failures else 0)

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
        logits[start + j, token] += 4.0 if (b + j) % 3 else 0.0


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

print("FAILED: " + "; ".join(failures) if failures else "OK")
sys.exit(1 if failures else 0)

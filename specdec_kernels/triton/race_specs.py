"""The race kernel's compile registry (``COMPILE_SPECS``): its configurations as the
launcher (``race.py``) uses them on a GPU, compiled for sm_80/sm_90 by bench/resources.py and
python_tests/test_triton_compile.py (registers, no spills). Kept apart from ``race.py``,
which holds the kernel and its launcher."""
from __future__ import annotations

from .._rng import PURPOSE_RESAMPLE, PURPOSE_SAMPLE
from ._launch import MAX_REGISTERS, next_pow2
from ._tiles import LOGPROBS_RAW
from .accept import Q_LOGITS, Q_LOGITS_T, Q_NONE, Q_ONE_HOT, Q_PROBS
from .race import STAGE_BOTH, STAGE_GROUPS, STAGE_TOKENS, _race_kernel
from .. import _rng


def _race_spec(dtype: str, q_dtype: str, q_mode: int, chunks: int, is_chain: bool = True,
               stage: int | None = None, stats_chunks: int = 1, q_stats_chunks: int = 1,
               features: bool = False, block_method: bool = False,
               mass_chunks: int = 1, slotted: bool = False) -> dict:
    q_mode = int(q_mode)
    mode = ["p", "one_hot", "draft_probs", "draft_logits", "draft_logits_t"][q_mode]
    stage = int(stage if stage is not None else STAGE_BOTH if chunks == 1 else STAGE_GROUPS)
    stage_name = ["", ",groups", ",tokens"][stage]
    stats_name = (f",stats_chunks={stats_chunks}" if stats_chunks > 1 else "") + \
        (f",q_stats_chunks={q_stats_chunks}" if q_stats_chunks > 1 else "") + \
        ((",bitmask+raw_logprobs" + (",packed" if is_chain else "")) if features else "")
    return dict(
        name=f"race[{dtype},{mode}{',chunks=%d' % chunks if chunks > 1 else ''}{stage_name}"
             f"{stats_name}{',block' if block_method else ''}{',slotted' if slotted else ''}]",
        kernel=_race_kernel,
        signature=dict(logits_ptr=f"*{dtype}", stride_req="i32", stride_row="i32",
                       rows_per_req="i32", stats_ptr="*fp32", argmax_ptr="*i32",
                       q_ptr=f"*{q_dtype}", stride_q_req="i32", stride_q_row="i32",
                       q_stats_ptr="*fp32", q_argmax_ptr="*i32", draft_ids_ptr="*i64",
                       stride_ids="i32", num_draft_tokens_ptr="*i32", num_accepted_ptr="*i32",
                       temperature_ptr="*fp32",
                       seed_ptr="*i64", offset_ptr="*i64", out_ptr="*i32", stride_out="i32",
                       part_score_ptr="*fp32", part_index_ptr="*i32", mass_ptr="*fp32",
                       V="i32", K="i32", chunk_size="i32", bitmask_ptr="*i32",
                       bitmask_words="i32", raw_ptr="*fp32", logprobs_ptr="*fp32",
                       stride_lp="i32", cu_ptr="*i64", num_packed="i32",
                       q_temperature_ptr="*fp32", slots_ptr="*i64", num_slots="i32"),
        constexprs=dict(PURPOSE=PURPOSE_RESAMPLE if is_chain else PURPOSE_SAMPLE,
                        IS_CHAIN=is_chain, Q_MODE=q_mode, STAGE=stage, NUM_CHUNKS=chunks,
                        CHUNKS_P2=next_pow2(chunks), STATS_CHUNKS=stats_chunks,
                        STATS_CHUNKS_P2=next_pow2(stats_chunks), Q_STATS_CHUNKS=q_stats_chunks,
                        Q_STATS_CHUNKS_P2=next_pow2(q_stats_chunks), GROUP=_rng.RACE_GROUP,
                        MASS_BLOCK=1024, BLOCK=512, K_P2=8 if is_chain else 1,
                        BLOCK_METHOD=block_method, MASS_CHUNKS=mass_chunks,
                        MASS_CHUNKS_P2=next_pow2(mass_chunks), HAS_BITMASK=features,
                        LOGPROBS=int(LOGPROBS_RAW) if features else 0,
                        PACKED=features and is_chain, SLOTTED=slotted),
        num_warps=4, maxnreg=MAX_REGISTERS)


# (kernel, argument types, constexprs, num_warps) of every kernel here, in the configurations
# the launchers use on a GPU: compiled for sm_80/sm_90 by bench/resources.py and the tests.
COMPILE_SPECS = [
    _race_spec("bf16", "fp32", Q_NONE, 1, is_chain=False, stats_chunks=16),
    _race_spec("bf16", "fp32", Q_ONE_HOT, 8, stats_chunks=4),
    _race_spec("bf16", "fp32", Q_PROBS, 1),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stats_chunks=4, q_stats_chunks=4),
    _race_spec("fp32", "fp32", Q_LOGITS, 1),
    _race_spec("bf16", "fp32", Q_PROBS, 8, stats_chunks=4),
    _race_spec("bf16", "fp32", Q_PROBS, 8, stage=STAGE_TOKENS, stats_chunks=4),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stage=STAGE_TOKENS, stats_chunks=4,
               q_stats_chunks=4),
    _race_spec("bf16", "fp32", Q_PROBS, 8, stats_chunks=4, block_method=True, mass_chunks=4),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stage=STAGE_TOKENS, stats_chunks=4,
               q_stats_chunks=4, block_method=True, mass_chunks=4),
    _race_spec("bf16", "fp32", Q_NONE, 1, is_chain=False, features=True),
    _race_spec("bf16", "fp32", Q_PROBS, 1, features=True),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, features=True),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stage=STAGE_TOKENS, features=True),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stage=STAGE_TOKENS, stats_chunks=4,
               q_stats_chunks=4, features=True, block_method=True, mass_chunks=4),
    # Per-slot draft rows (draft_slots) at their own temperature: vLLM MRV2's layout.
    _race_spec("bf16", "bf16", Q_LOGITS_T, 1, slotted=True),
    _race_spec("bf16", "bf16", Q_LOGITS_T, 8, stats_chunks=4, q_stats_chunks=4, slotted=True),
    _race_spec("bf16", "bf16", Q_LOGITS_T, 8, stage=STAGE_TOKENS, stats_chunks=4,
               q_stats_chunks=4, features=True, block_method=True, mass_chunks=4,
               slotted=True),
    _race_spec("bf16", "fp32", Q_PROBS, 1, features=True, slotted=True),
]

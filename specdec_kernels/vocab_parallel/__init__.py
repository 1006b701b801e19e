"""Verification on vocabulary shards (contract section 17): each rank of a tensor-parallel
group holds its slice of the vocabulary of every row; the ranks exchange per-row summaries
(``O(rows x P)`` numbers), never the rows, and every rank returns the unsharded op's outputs.

The public ops take ``vocab_shard=VocabShard(start, vocab_size, group)`` and dispatch here;
this package can also be called directly. docs/vocab_parallel.md is the manual.

Layering: above ``reference`` and ``_params`` (it reuses the reference's definitions), below
the public ops (``chain``, ``sampling``), which import it lazily.
"""
from ._comm import CollectiveStats, VocabShard, count_collectives
from .chain import sample, verify_chain, verify_chain_packed
from .tree import verify_tree

__all__ = ["VocabShard", "count_collectives", "CollectiveStats", "sample", "verify_chain",
           "verify_chain_packed", "verify_tree"]

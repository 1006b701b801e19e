"""Fuzz: bad input raises ValueError/TypeError naming the argument and writes nothing
(contract section 7). Each example draws a valid call of a public op, breaks one argument
(a value outside the contract, a wrong dtype or shape, not a tensor, a device without data)
and checks the error, that no input changed (guard regions included) and that torch's
generator did not advance."""
import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels as sk
from calls import KV_OPS, OPS, draw_call
from strategies import (BAD_FLAGS, BAD_METHOD, BAD_RNG, BAD_SAMPLING, BAD_TREE_ATTENTION,
                        METHODS, examples)

SEEDED_OPS = ("sample", "verify_chain", "verify_chain_packed", "verify_tree")
PER_REQUEST_BAD = {"processed_probs": BAD_SAMPLING,
                   **{op: {**BAD_SAMPLING, **BAD_RNG} for op in SEEDED_OPS},
                   "build_tree_attention": BAD_TREE_ATTENTION}


def _live(call, name, default):
    """Per-request counts (num_draft_tokens / num_nodes) as a list, default when absent."""
    value = call.kwargs.get(name)
    if value is None:
        return [default] * call.dims.batch
    if isinstance(value, torch.Tensor):
        return value.expand(call.dims.batch).tolist()
    return [value] * call.dims.batch


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


def _value_mutations(call, draw):
    """(name, mutate) pairs applicable to this call: each breaks one value."""
    d, kw, out = call.dims, call.kwargs, []
    for name, (bad, error) in PER_REQUEST_BAD.get(call.op, {}).items():
        def mutate(name=name, bad=bad, error=error):
            value = draw(bad)
            if call.op == "build_tree_attention" and not d.batch and -2**63 <= value < 2**63:
                return None  # its ints are checked per request (validate): none at B = 0
            form = draw(st.sampled_from(["scalar", "tensor"])) if d.batch else "scalar"
            if form == "tensor" and not isinstance(value, float) and not -2**63 <= value < 2**63:
                form = "scalar"
            if form == "tensor":
                dtype = torch.float64 if isinstance(value, float) else torch.int64
                if name == "seed" or name == "offset":  # only integral tensors are seeds
                    return None
                value = torch.full((d.batch,), value, dtype=dtype)
            kw[name] = value
            return name, error
        out.append(mutate)
    if call.op == "verify_chain":
        n = _live(call, "num_draft_tokens", d.rows - 1)
        live = [(b, j) for b in range(d.batch) for j in range(n[b])]
        if live:
            def bad_draft():
                kw["draft_token_ids"] = _set(kw["draft_token_ids"], draw(st.sampled_from(live)),
                                             draw(st.sampled_from([-1, d.vocab, 2**40])))
                return "draft_token_ids", ValueError
            out.append(bad_draft)
        if d.batch:
            def bad_count():
                kw["num_draft_tokens"] = draw(st.sampled_from([-1, d.rows]))
                return "num_draft_tokens", ValueError
            out.append(bad_count)
    if call.op in SEEDED_OPS:
        for name, (bad, error) in BAD_FLAGS.items():
            def bad_flag(name=name, bad=bad, error=error):
                kw[name] = draw(bad)
                return name, error
            out.append(bad_flag)
    if call.op in METHODS:
        def bad_method():
            kw["method"] = draw(BAD_METHOD[0])
            return "method", BAD_METHOD[1]
        if "method" in inspect.signature(getattr(sk, call.op)).parameters:
            out.append(bad_method)
    if call.op == "verify_chain_packed":
        out += _packed_mutations(call, draw)
    if call.op in ("verify_tree", "build_tree_attention") and d.batch:
        n = _live(call, "num_nodes", d.rows)
        b = draw(st.integers(0, d.batch - 1))

        def bad_root():
            kw["parents"] = _set(kw["parents"], (b, 0), draw(st.sampled_from([0, 1, -2])))
            return "parents", ValueError
        out.append(bad_root)
        if n[b] > 1:
            i = draw(st.integers(1, n[b] - 1))

            def bad_edge():
                kw["parents"] = _set(kw["parents"], (b, i), draw(st.sampled_from([i, -1, i + 5])))
                return "parents", ValueError
            out.append(bad_edge)
            if call.op == "verify_tree":
                def bad_token():
                    kw["tree_token_ids"] = _set(kw["tree_token_ids"], (b, i), d.vocab)
                    return "tree_token_ids", ValueError
                out.append(bad_token)
    if call.op in KV_OPS and d.batch:
        b = draw(st.integers(0, d.batch - 1))
        nodes = d.rows

        def bad_len():
            kw["kv_lens"] = _set(kw["kv_lens"], b, -1)
            return "kv_lens", ValueError

        def bad_count():
            kw["num_accepted"] = _set(kw["num_accepted"], b, draw(st.sampled_from([-1, nodes])))
            return "num_accepted", ValueError

        def bad_root():
            kw["accepted_nodes"] = _set(kw["accepted_nodes"], (b, 0), 1)
            return "accepted_nodes", ValueError

        def past_cache():
            kw["kv_lens"] = _set(kw["kv_lens"], b, torch.iinfo(kw["kv_lens"].dtype).max)
            return "accepted_nodes", ValueError

        def overlapping():
            again = draw(st.integers(0, len(kw["caches"]) - 1))
            kw["caches"] = kw["caches"] + [kw["caches"][again]]
            return "caches", ValueError
        out += [bad_len, bad_count, bad_root, past_cache, overlapping]
        if int(kw["num_accepted"][b]) >= 1:
            def bad_order():
                path = kw["accepted_nodes"]
                k = int(kw["num_accepted"][b])
                kw["accepted_nodes"] = _set(path, (b, k), int(path[b, k - 1]))
                return "accepted_nodes", ValueError
            out.append(bad_order)
        if call.op == "compact_paged_kv_cache":
            def bad_block():
                block_size = kw["caches"][0].shape[1]
                column = int(kw["kv_lens"][b]) // block_size
                kw["block_tables"] = _set(kw["block_tables"], (b, column), draw(
                    st.sampled_from([-1, kw["caches"][0].shape[0]])))
                return "block_tables", ValueError
            out.append(bad_block)
        else:
            def bad_layout():
                kw["layout"] = draw(st.sampled_from(["BSHD", "paged", 3]))
                return "layout", (ValueError, TypeError)
            out.append(bad_layout)
    return out


TENSOR_ARGS = ("logits", "target_logits", "draft_token_ids", "draft_probs", "draft_logits",
               "tree_token_ids", "parents", "num_draft_tokens", "cu_num_draft_tokens",
               "num_nodes", "prefix_lens", "temperature", "top_k", "top_p", "min_p",
               "token_bitmask", "seed", "offset", "kv_lens", "accepted_nodes", "num_accepted",
               "block_tables")
INDEX_ARGS = ("draft_token_ids", "tree_token_ids", "parents", "kv_lens", "accepted_nodes",
              "num_accepted", "block_tables", "num_nodes", "prefix_lens", "token_bitmask",
              "cu_num_draft_tokens")
# Tensors that do not set the call's device (the logits, parents and caches do).
META_ARGS = ("kv_lens", "accepted_nodes", "num_accepted", "block_tables", "num_nodes",
             "prefix_lens", "draft_token_ids", "tree_token_ids", "draft_probs", "temperature",
             "top_k", "top_p", "min_p", "token_bitmask", "cu_num_draft_tokens", "seed",
             "offset")


def _packed_mutations(call, draw):
    """Contract section 10's bad offsets (a ValueError naming cu_num_draft_tokens), a bad
    live draft id, a bad max_draft_tokens."""
    kw, out = call.kwargs, []
    cu = kw["cu_num_draft_tokens"]
    batch, num_packed = cu.shape[0] - 1, kw["draft_token_ids"].shape[0]

    def first_not_zero():
        kw["cu_num_draft_tokens"] = _set(cu, 0, draw(st.sampled_from([1, -1])))
        return "cu_num_draft_tokens", ValueError

    def wrong_total():  # cu[B] != T, rows still T + B
        kw["cu_num_draft_tokens"] = _set(cu, batch, int(cu[batch]) + draw(st.sampled_from([1, -1])))
        return "cu_num_draft_tokens", ValueError

    def wrong_rows():  # target rows != T + B
        target = kw["target_logits"]
        kw["target_logits"] = torch.cat([target, target[:1]]) if target.shape[0] else \
            torch.zeros(1, target.shape[1], dtype=target.dtype)
        return "cu_num_draft_tokens", ValueError
    out += [first_not_zero, wrong_rows]
    if batch:
        out.append(wrong_total)
    counts = (cu[1:] - cu[:-1]).tolist()
    if any(counts):
        b = next(i for i, n in enumerate(counts) if n)

        def decreasing():  # request b's end before its start, the total kept
            if b + 1 == batch:
                return None
            kw["cu_num_draft_tokens"] = _set(cu, b + 1, int(cu[b]) - 1)
            return "cu_num_draft_tokens", ValueError

        def past_max():  # n_b > max_draft_tokens
            kw["max_draft_tokens"] = counts[b] - 1
            return "cu_num_draft_tokens", ValueError

        def bad_draft():
            t = draw(st.integers(0, num_packed - 1))
            kw["draft_token_ids"] = _set(kw["draft_token_ids"], t,
                                         draw(st.sampled_from([-1, call.dims.vocab, 2**40])))
            return "draft_token_ids", ValueError
        out += [decreasing, past_max, bad_draft]

    def bad_max():
        value, error = draw(st.sampled_from([(-1, ValueError), (1.0, TypeError),
                                             (True, TypeError), (2**62, ValueError)]))
        kw["max_draft_tokens"] = value
        return "max_draft_tokens", error
    out.append(bad_max)
    return out


def _structural_mutations(call, draw):
    kw, out = call.kwargs, []
    for name in TENSOR_ARGS:
        value = kw.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if name in INDEX_ARGS or name in ("logits", "target_logits", "draft_probs",
                                          "draft_logits"):
            def wrong_dtype(name=name, value=value):
                kw[name] = value.to(torch.float32 if name in INDEX_ARGS else torch.int32)
                return name, (TypeError, ValueError)
            out.append(wrong_dtype)
        if not (call.op == "processed_probs" and name == "logits"):
            def wrong_shape(name=name, value=value):
                kw[name] = value[None, None].expand(2, 1, *value.shape)
                return name, ValueError
            out.append(wrong_shape)

        def not_a_tensor(name=name, value=value):
            kw[name] = value.tolist() if value.dim() else [value.item()]
            return name, TypeError
        out.append(not_a_tensor)
        if name in META_ARGS:
            def on_meta(name=name, value=value):
                kw[name] = value.to("meta")
                return name, ValueError
            out.append(on_meta)
    if call.op in KV_OPS:
        def cache_not_tensor():
            kw["caches"] = list(kw["caches"]) + ["cache"]
            return "caches", TypeError
        out.append(cache_not_tensor)
    return out


@pytest.mark.parametrize("op", OPS)
@examples(60)
@given(data=st.data())
def test_bad_input_names_the_argument_and_writes_nothing(op, data):
    call = data.draw(draw_call(op), label="call")
    mutations = _value_mutations(call, data.draw) + _structural_mutations(call, data.draw)
    mutation = data.draw(st.sampled_from(mutations), label="mutation")
    broken = mutation()
    if broken is None:
        return
    name, error = broken
    if "seed" not in call.kwargs and op in SEEDED_OPS:
        call.kwargs["seed"] = None  # torch's generator must not advance on a rejected call
    state = torch.get_rng_state()
    with pytest.raises(error) as caught:
        call.run()
    message = str(caught.value)
    assert message.startswith(f"{name}") or f"{name}:" in message or f"{name}[" in message, \
        f"{type(caught.value).__name__} does not name {name}: {message}"
    assert call.nothing_written()
    assert torch.equal(torch.get_rng_state(), state)

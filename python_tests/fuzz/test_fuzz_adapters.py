"""Fuzz the engine adapters (issue 47's surfaces; contract sections 7 and 14): each example
draws a valid call of an adapter in its engine's layout (vLLM V1 with every draft-row feature,
vLLM MRV2, SGLang and FlashInfer at batch sizes from 0), breaks one argument from
``adapter_calls``' tables and checks that the named exception is raised with a message that
starts with the argument's name, that no tensor the call was given changed (``logits`` written
in place by vLLM's features included, byte for byte), and that neither torch's generator nor a
request's advanced and vLLM's bonus Sampler never ran."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adapter_calls import CALLS, MUTATION_NAMES, SURFACES, DrawingSampler
from strategies import examples


def _tensors(value, seen=None):
    """Every tensor reachable from a call's arguments (dicts, lists, dataclasses, namespaces)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = vars(value)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.Generator)):
        value = vars(value)
    if isinstance(value, dict):
        return [t for v in list(value.keys()) + list(value.values()) for t in _tensors(v, seen)]
    if isinstance(value, (list, tuple, set)):
        return [t for v in value for t in _tensors(v, seen)]
    return []


def _generators(value, seen=None):
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Generator):
        return [value]
    if isinstance(value, dict):
        return [g for v in value.values() for g in _generators(v, seen)]
    if isinstance(value, (list, tuple)):
        return [g for v in value for g in _generators(v, seen)]
    return []


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as it is, NaNs included (clone keeps every bit)."""
    return tensor.detach().clone()


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (a NaN written over a NaN, or -0.0 over 0.0, is a change too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_bytes = lambda x: x.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(as_bytes(a), as_bytes(b)) if a.numel() else True


MUTATIONS = [(surface, name) for surface in SURFACES for name in MUTATION_NAMES[surface]]


@pytest.mark.parametrize("surface, name", MUTATIONS, ids=[f"{s}-{n}" for s, n in MUTATIONS])
@examples(5)
@given(data=st.data())
def test_bad_adapter_input_names_the_argument_and_changes_nothing(surface, name, data):
    draw_call, mutations, run = CALLS[surface]
    call = data.draw(draw_call(), label="call")
    table = mutations(call)
    assert sorted(table) == sorted(MUTATION_NAMES[surface]), "MUTATION_NAMES is out of date"
    error, argument, mutate = table[name]
    if mutate() is False:
        return
    if surface == "vllm":
        call["sampler"] = DrawingSampler()
    given_tensors = [(t, _bytes(t)) for t in _tensors(call)]
    generators = _generators(call.get("sm", call))
    states = [g.get_state() for g in generators]
    default = torch.get_rng_state()
    with pytest.raises(error) as caught:
        run(call)
    message = str(caught.value)
    assert message.startswith(argument), f"{name}: {type(caught.value).__name__} {message}"
    for tensor, before in given_tensors:
        assert _identical(tensor, before), f"{name}: a rejected call wrote into an input"
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states)), name
    assert torch.equal(torch.get_rng_state(), default), f"{name}: torch's generator advanced"
    if surface == "vllm":
        assert call["sampler"].calls == 0, f"{name}: the bonus Sampler ran"


@pytest.mark.parametrize("surface", SURFACES)
@examples(10)
@given(data=st.data())
def test_the_drawn_adapter_calls_are_valid(surface, data):
    """The unbroken calls run: each error above is the mutation's, not the draw's."""
    draw_call, _, run = CALLS[surface]
    run(data.draw(draw_call(), label="call"))

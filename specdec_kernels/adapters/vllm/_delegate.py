"""vLLM's own classes, for the modes we delegate (lossy or vLLM-specific): found even after a
swap line replaced the module attribute with ours."""
from __future__ import annotations

import importlib
import importlib.util
import sys


def keep_own_class(module_name: str, kept: list) -> None:
    """Keep vLLM's own ``RejectionSampler`` while ``module_name`` still names it (a swap line
    imports vLLM's module, then ours, then replaces the attribute): ``kept`` holds it, a
    strong reference, since after the swap nothing else does."""
    module = sys.modules.get(module_name)
    candidate = getattr(module, "RejectionSampler", None)
    if isinstance(candidate, type) and candidate.__module__ == module_name and not kept:
        kept.append(candidate)


def own_class(module_name: str, kept: list, base: type) -> type:
    """vLLM's own ``RejectionSampler`` of ``module_name`` (a subclass of ``base``); raises
    ImportError without vLLM."""
    importlib.import_module(module_name)
    keep_own_class(module_name, kept)
    if kept:
        return kept[0]
    for cls in base.__subclasses__():  # still alive, not yet collected
        if cls.__module__ == module_name and cls.__name__ == "RejectionSampler":
            kept.append(cls)
            return cls
    # Swapped before we were imported and collected since: a private copy of vLLM's module.
    spec = importlib.util.find_spec(module_name)
    private = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(private)
    kept.append(private.RejectionSampler)
    return private.RejectionSampler

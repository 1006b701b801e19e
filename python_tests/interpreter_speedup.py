"""Triton's interpreter patches ``triton.language`` once per launch, then again on every call of
a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__`` calls
``_patch_lang`` and never restores that scope): a scan of every member of ``tl``, ``tl.core``,
``tl.math`` and ``tl.tensor``, per helper call and program. Measured on our search kernels,
that is ~27% of the interpreter's time (``python -m cProfile``, Triton 3.8).

Inside a launch, once the launch (or an earlier helper) has patched the language modules a
helper's module sees, a second patch of them changes nothing: ``_patch_builtin`` finds no
builtin left to wrap, and the other attributes it sets are equal functions. ``install()``
skips exactly that case. Everything else patches as before: the launch itself, a helper that
sees a module not patched yet in this launch, a ``@triton.jit`` function called outside any
launch; the launch's restore still undoes it all. Each launch (``GridExecutor.__call__``)
keeps its own record of what it patched, per thread. Installed by conftest.py under
``TRITON_INTERPRET=1``; a Triton whose interpreter lacks this shape is left alone.
"""
from __future__ import annotations

import functools
import inspect
import threading


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Wraps ``triton.runtime.interpreter._patch_lang`` and ``GridExecutor.__call__``;
    returns whether they are wrapped."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or not callable(getattr(executor, "__call__", None)):
        return False
    if getattr(original, "_specdec_once", False):
        return True
    launches = threading.local()  # .patched: ids of the modules the launch in progress patched

    def patch_lang(fn):
        patched = getattr(launches, "patched", None)
        langs = {id(v) for v in fn.__globals__.values()
                 if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched is not None and langs and langs <= patched:
            return _NothingToRestore()
        scope = original(fn)
        if patched is not None:
            patched.update(langs)
        return scope

    launch = executor.__call__

    @functools.wraps(launch)
    def launch_recording_patches(self, *args, **kwargs):
        outer = getattr(launches, "patched", None)
        launches.patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.patched = outer

    patch_lang._specdec_once = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch_recording_patches
    return True

"""Triton's interpreter patches ``triton.language`` once per launch, then again on every call of
a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__`` calls
``_patch_lang`` and never restores that scope): a scan of every member of ``tl``, ``tl.core``,
``tl.math`` and ``tl.tensor``, per helper call and program. Measured on our search kernels,
that is ~27% of the interpreter's time (``python -m cProfile``, Triton 3.8).

While a launch's patch is in place, a helper whose module sees the same language modules finds
them patched already: a second patch changes nothing. ``install()`` skips exactly that case and
patches as before otherwise (first sight of ``tl.core`` in a helper, calls outside a launch).
It changes what is executed in no kernel; the tests comparing kernels with references are the
same tests. Installed by conftest.py under ``TRITON_INTERPRET=1``; a Triton whose interpreter
lacks this shape is left alone.
"""
from __future__ import annotations

import inspect


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Wraps ``triton.runtime.interpreter._patch_lang``; returns whether it did."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_specdec_once", False):
        return original is not None
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if scope_type is None:
        return False
    patched: set[int] = set()  # ids of the language modules patched by the launch in progress
    langs_of: dict = {}  # function -> ids of the language modules its module sees

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        if patched and langs <= patched:
            return _NothingToRestore()
        launch_level = not patched  # helpers only run inside a launch, which patched first
        scope = original(fn)
        patched.update(langs)
        if launch_level and isinstance(scope, scope_type):
            restore = scope.restore

            def restore_and_forget():
                try:
                    restore()
                finally:
                    patched.clear()
            scope.restore = restore_and_forget
        return scope

    patch_lang._specdec_once = True
    interpreter._patch_lang = patch_lang
    return True

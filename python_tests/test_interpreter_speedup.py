"""interpreter_speedup.py (installed by conftest.py under TRITON_INTERPRET=1): a launch whose
helpers skip the repeated language patch computes what it did, and leaves triton.language as
it found it."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter's patch exists under TRITON_INTERPRET=1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _twice(x):
    return tl.where(x > 0, x * 2, -x)


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _twice(_twice(x)) + tl.sum(x, 0))


def test_installed_once_and_launches_restore_the_language():
    from triton.runtime import interpreter

    from interpreter_speedup import install

    assert install() and install()  # conftest installed it; a second install is a no-op
    assert getattr(interpreter._patch_lang, "_specdec_once", False)

    before = {name: getattr(tl, name) for name in ("where", "sum", "load", "store", "arange")}
    x = torch.tensor([-3.0, -1.0, 0.0, 2.0, 5.0, -0.5, 7.0, 1.0])
    out = torch.empty_like(x)
    for _ in range(2):  # the second launch finds the language unpatched again
        _kernel[(1,)](x, out, N=8)
        once = torch.where(x > 0, x * 2, -x)
        torch.testing.assert_close(out, torch.where(once > 0, once * 2, -once) + x.sum())
        assert {name: getattr(tl, name) for name in before} == before

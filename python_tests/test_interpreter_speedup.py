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


_SEQUENCE = """
import sys, torch, triton, triton.language as tl
if sys.argv[1] == "patched":
    sys.path.insert(0, sys.argv[2])
    import interpreter_speedup
    assert interpreter_speedup.install()
sys.path.insert(0, sys.argv[3])
import speedup_core_only


@triton.jit
def identity(x):
    return x


@triton.jit
def kernel(p, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(p + offs)
    tl.store(p + offs, x + 1 + tl.zeros_like(x))  # zeros_like: a helper seeing tl.core only


identity(3)  # outside any launch: it patches, and nothing restores that
p = torch.zeros(4)
speedup_core_only.kernel[(1,)](p)
kernel[(1,)](p, N=4)
print(p.tolist())
"""


def test_calls_outside_a_launch_and_core_only_modules_patch_as_before(tmp_path):
    """In a fresh process (what earlier launches leave patched differs by test order): a jit
    function called outside any launch, a kernel whose module sees only triton.language.core,
    then one whose helper sees only tl.core. The output equals stock Triton's (an earlier
    version kept a stale record after the first call and skipped a needed patch: it failed
    with "Did you forget to add @triton.jit")."""
    import subprocess
    import sys
    (tmp_path / "speedup_core_only.py").write_text(
        "import triton\nfrom triton.language import core\n\n\n@triton.jit\n"
        "def kernel(p):\n    x = core.load(p)\n    core.store(p, x + 1)\n")
    script = tmp_path / "sequence.py"
    script.write_text(_SEQUENCE)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    outputs = [subprocess.run([sys.executable, str(script), mode, here, str(tmp_path)],
                              capture_output=True, text=True, env=env, timeout=120)
               for mode in ("stock", "patched")]
    for run in outputs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert outputs[0].stdout == outputs[1].stdout == "[2.0, 1.0, 1.0, 1.0]\n"

"""Without the compiled extension (an engine's environment where it could not be built) the
package imports with one RuntimeWarning and the verify ops run on the reference backend."""
import subprocess
import sys
import textwrap


def test_the_package_runs_without_its_extension_with_one_warning():
    script = textwrap.dedent("""
        import importlib.abc, sys, warnings
        class NoExtension(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "specdec_kernels._C":
                    raise ImportError("blocked by the test")
        sys.meta_path.insert(0, NoExtension())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import specdec_kernels as sk
        import torch
        ours = [w for w in caught if "compiled extension is not available" in str(w.message)]
        assert len(ours) == 1 and ours[0].category is RuntimeWarning, [str(w.message) for w in caught]
        logits = torch.randn(2, 3, 16)
        drafts = torch.randint(0, 16, (2, 2))
        out = sk.verify_chain(logits, drafts, temperature=1.0, seed=torch.tensor([1, 2]))
        ref = sk.verify_chain(logits, drafts, temperature=1.0, seed=torch.tensor([1, 2]),
                              backend="reference")
        assert torch.equal(out.output_token_ids, ref.output_token_ids)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

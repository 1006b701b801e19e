"""The benchmark harness (bench/): a tiny CPU sweep end to end, the byte formulas, the
baselines' algorithm and the speculation model's formula. Runs in a few seconds on CPU."""
from __future__ import annotations

import csv
import importlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import specdec_kernels as sk
from bench import baselines, harness, spec_model
from bench.__main__ import main as bench_main
from bench.ops import chain as chain_op
from bench.ops import compact as compact_op
from bench.ops import tree as tree_op

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench_main(["--quick", "--device", "cpu", "--out", str(out), "--no-progress",
                       "--ops", "chain,tree,sample,mask,compact,extension,model"]) == 0
    return out


def test_quick_sweep_writes_rows_with_required_keys(quick_run):
    rows = json.loads((quick_run / "results.json").read_text())
    assert rows, "no rows written"
    for row in rows:
        missing = [k for k in harness.REQUIRED_KEYS if k not in row]
        assert not missing, f"row {row['op']} {row['backend']} lacks {missing}"
        assert row["min_bytes"] > 0, row
        assert row["device"] == "cpu"
        assert row["status"] in ("ok", "skipped", "error")
    ok = [r for r in rows if r["status"] == "ok"]
    errors = [(r["op"], r["backend"], r["note"]) for r in rows if r["status"] == "error"]
    assert not errors, errors
    # Every op family ran, with our reference path and at least one baseline for the chain.
    assert {r["op"] for r in ok} >= {"chain", "tree", "sample", "mask", "compact"}
    chain_backends = {r["backend"] for r in ok if r["op"] == "chain"}
    assert {"reference", "torch_unfused", "vllm_style"} <= chain_backends
    for r in ok:
        assert r["median_us"] > 0 and r["gbps"] > 0 and r["pct_copy_bw"] > 0, r
    # The extension's own benchmark lands in the same rows (or one skipped row says why).
    assert any(r["op"] == "build_tree_attention" for r in rows)
    # Skipped rows say why (Triton and FlashInfer need a GPU here).
    for r in rows:
        if r["status"] == "skipped":
            assert r["note"], r


def test_quick_sweep_writes_csv_matching_json(quick_run):
    rows = json.loads((quick_run / "results.json").read_text())
    with open(quick_run / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows)
    assert set(harness.REQUIRED_KEYS) <= set(csv_rows[0])
    assert [r["backend"] for r in csv_rows] == [r["backend"] for r in rows]


def test_quick_sweep_writes_plots_and_model(quick_run):
    for name in ("latency_vs_batch.png", "roofline_vs_vocab.png", "spec_model.png"):
        path = quick_run / name
        assert path.exists() and path.read_bytes()[:8] == PNG_MAGIC, name
    model_rows = json.loads((quick_run / "spec_model.json").read_text())
    assert {r["agreement"] for r in model_rows} == set(spec_model.AGREEMENT)
    meta = json.loads((quick_run / "meta.json").read_text())
    assert set(meta["byte_formulas"]) == {"chain", "tree", "sample", "mask", "compact"}


def test_speculation_model_formula_by_hand():
    # alphas 0.8, 0.5: E_2 = 1 + 0.8 + 0.8*0.5 = 2.2; with c = 0.1, speedup = 2.2 / 1.2.
    assert spec_model.expected_tokens([0.8, 0.5], 2) == pytest.approx(2.2)
    assert spec_model.speedup([0.8, 0.5], 2, 0.1) == pytest.approx(2.2 / 1.2)
    assert spec_model.expected_tokens([0.8, 0.5], 0) == 1.0
    assert spec_model.speedup([0.8, 0.5], 1, 0.5) == pytest.approx(1.8 / 1.5)
    # Constant rates reduce to Leviathan et al.'s closed form.
    for alpha in (0.0, 0.3, 0.9, 1.0):
        for k in (1, 4, 8):
            assert spec_model.speedup([alpha] * k, k, 0.2) == pytest.approx(
                spec_model.leviathan_speedup(alpha, k, 0.2))
    # Drafting loses when the draft is expensive and rarely accepted.
    assert spec_model.speedup([0.1] * 4, 4, 0.5) < 1


def test_speculation_model_measurement():
    # A draft equal to the target is always accepted (u * q < p with u < 1 and p = q > 0).
    same = spec_model.measure_acceptance(0.0, num_drafts=3, batch=64, vocab=32)
    assert same["alphas"] == [1.0, 1.0, 1.0]
    assert same["chain_mean_accepted"] == 3.0
    # A noisy draft: measured rates within 5 standard errors of sum(min(p, q)) (false alarm
    # ~1e-6 per position), and the chain's mean accepted length close to E_K - 1.
    m = spec_model.measure_acceptance(2.0, num_drafts=3, batch=512, vocab=64, seed=3)
    for measured, expected in zip(m["alphas"], m["alphas_expected"]):
        assert abs(measured - expected) < 5 * math.sqrt(expected * (1 - expected) / 512) + 0.01
    assert m["chain_mean_accepted"] == pytest.approx(m["model_mean_accepted"], abs=0.15)


def test_chain_byte_formula_by_hand():
    case = harness.Case("chain", {"B": 2, "K": 3, "V": 10}, "bf16", "draft_probs")
    # logits 2*4*10*2 + ids 2*3*4 + outputs 2*4*4 + 2*4 + params 2*20 + q(d) 2*3*4 + q row 2*10*4
    assert chain_op.min_bytes(case) == 160 + 24 + 32 + 8 + 40 + 24 + 80
    onehot = harness.Case("chain", {"B": 2, "K": 3, "V": 10}, "fp32", "onehot")
    assert chain_op.min_bytes(onehot) == 320 + 24 + 32 + 8 + 40


def test_compaction_bytes_count_only_moved_positions():
    accepted = torch.tensor([[0, 1, 2, -1], [0, 2, 3, -1], [0, -1, -1, -1]], dtype=torch.int32)
    num = torch.tensor([2, 2, 0], dtype=torch.int32)
    assert compact_op.moved_positions(accepted, num) == 2  # chain path and root-only move nothing


def test_eagle_tree_is_a_tree():
    for n in (1, 8, 32, 64):
        parents, rank = tree_op.eagle_tree(n)
        assert len(parents) == n and parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(parents) if i > 0)


def _point_mass_logits(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = torch.full((*tokens.shape, vocab), -30.0)
    return logits.scatter_(-1, tokens[..., None], 30.0)


@pytest.mark.parametrize("use_probs", [False, True])
def test_baselines_run_the_contract_algorithm(use_probs):
    # Point-mass targets make every sampled decision deterministic, so the baselines (torch
    # RNG) must emit exactly the reference's tokens: accept while the draft is the target's
    # token, then emit the target's token.
    vocab, batch, k = 16, 6, 4
    gen = torch.Generator().manual_seed(0)
    wanted = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    drafts = wanted[:, :k].clone()
    for b in range(batch):
        if b < k:
            drafts[b, b] = (wanted[b, b] + 1) % vocab  # first mismatch at position b
    target = _point_mass_logits(wanted, vocab)
    draft_probs = None
    if use_probs:
        draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    ref = sk.verify_chain(target, drafts, draft_probs=draft_probs, seed=1, backend="reference")
    for fn in (baselines.unfused_chain, baselines.vllm_style_chain):
        out, num = fn(target, drafts.to(torch.int32), draft_probs, 1.0)
        assert torch.equal(out, ref.output_token_ids), fn.__name__
        assert torch.equal(num, ref.num_accepted), fn.__name__
    # Greedy on random logits: deterministic too.
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = logits[:, :k].argmax(-1)
    drafts[0, 1] = (drafts[0, 1] + 1) % vocab
    ref = sk.verify_chain(logits, drafts, temperature=0.0, backend="reference")
    out, num = baselines.unfused_chain(logits, drafts, None, 0.0)
    assert torch.equal(out, ref.output_token_ids) and torch.equal(num, ref.num_accepted)


def test_harness_timing_and_rotation():
    timing = harness.time_cpu(lambda x: x.sum(), [torch.ones(1000)], min_samples=3, budget_s=0.01)
    assert timing.samples >= 3 and timing.median_us > 0
    assert timing.p20_us <= timing.median_us <= timing.p80_us
    env = harness.Environment(torch.device("cpu"), "cpu", "t", "t", "c", False, "h", "now",
                              copy_bw_gbps=10.0)
    assert harness.rotation_copies(1 << 20, env) == 1  # no rotation on CPU
    env.device = torch.device("cuda")  # rotation arithmetic only: no GPU is touched
    env.l2_bytes = 50 << 20
    assert harness.rotation_copies(1 << 20, env) == 101  # > 2 x L2 of fresh inputs
    assert harness.rotation_copies(4 << 30, env) == 2    # never fewer than 2
    case = harness.Case("chain", {"B": 1}, "fp32", "x")
    rows = [harness.make_row(case, b, "ours", env, timing=harness.Timing(t, t, t, 1, 1),
                             min_bytes=10_000) for b, t in (("torch_unfused", 60.0), ("triton", 10.0))]
    harness.add_speedups(rows)
    assert rows[1]["speedup_vs_baseline"] == 6.0
    assert rows[1]["gbps"] == pytest.approx(1.0)          # 10 kB in 10 us
    assert rows[1]["pct_copy_bw"] == pytest.approx(10.0)  # of 10 GB/s


def test_bench_imports_never_touch_cuda(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the GPU was queried at import")
    for name in ("is_available", "device_count", "get_device_properties", "get_device_name",
                 "synchronize", "current_device"):
        monkeypatch.setattr(torch.cuda, name, boom)
    for module in ("bench", "bench.harness", "bench.baselines", "bench.plots", "bench.spec_model",
                   "bench.ops", "bench.ops.chain", "bench.ops.tree", "bench.ops.sample",
                   "bench.ops.mask", "bench.ops.compact", "bench.__main__"):
        importlib.reload(importlib.import_module(module))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


def test_gpu_check_lists_existing_cuda_tests():
    """Every test the GPU check runs on CUDA exists (a renamed test would be silently
    skipped on the one GPU call a session gets)."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    block = script.split("TEST_ARGS=(python_tests/test_triton_chain.py", 1)[1].split(")", 1)[0]
    targets = ["python_tests/test_triton_chain.py"] + block.split()
    for target in targets:
        path, _, name = target.partition("::")
        assert (ROOT / path).is_file(), target
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), target


def test_method_gain_measurement():
    """The methods' gain table (docs/methods.md): a draft equal to the target accepts
    everything with every method; a noisy draft gains >= 0 with block (pointwise) and the
    table renders."""
    same = spec_model.chain_method_gain(0.0, num_drafts=3, batch=32, vocab=16)
    assert same["token_exact"] == pytest.approx(3.0) and same["block"] == pytest.approx(3.0)
    assert same["token_measured"] == same["block_measured"] == 3.0
    noisy = spec_model.chain_method_gain(1.5, num_drafts=3, batch=64, vocab=16)
    assert noisy["block_gain"] > 0 and noisy["block"] >= noisy["token_exact"]
    assert spec_model.binary_tree(2) == [-1, 0, 1, 1, 0, 4, 4]
    tree = spec_model.tree_method_gain(0.0, depth=2, batch=32, vocab=16)
    assert tree["token"] == tree["traversal"] == 2.0
    text = spec_model.method_gain_summary({"chain": [{"agreement": "x", **noisy}],
                                           "tree": [{"agreement": "x", **tree}]})
    assert "| x | 3 |" in text and "binary, depth 2 (6 drafts)" in text

"""bench.e2e with the adaptive policy patched at batch >= 8; VARIANT picks the change (base,
probe1, gap8, halve, gated). From the repository root:
VARIANT=gap8 python bench/results/cpu-2026-12-06/probe_length/variant.py --preset issue26 \
    --groups 2,3 --repeats 3 --threads 1 --no-plots --out /tmp/gap8"""
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import specdec_kernels.e2e.engine as engine
from specdec_kernels.e2e.adaptive import AdaptiveLength
variant = os.environ.get("VARIANT", "base")

class Patched(AdaptiveLength):
    def __init__(self, batch, max_len, **kw):
        self.held = {}  # gated: row -> its gap before a probe that accepted
        if variant == "probe1" and batch >= 8 and kw.get("probe_length", 4) > 1:
            kw["probe_length"] = 1
        if variant == "gap8" and batch >= 8:
            kw["probe_every"] = 8
        super().__init__(batch, max_len, **kw)
    def observe(self, b, drafted, accepted):
        probing, gap = self.probing[b], self.gap[b]
        super().observe(b, drafted, accepted)
        if self.batch < 8 or not (probing and accepted):
            return
        if variant == "halve":
            self.gap[b] = max(self.probe_every, gap // 2)
        if variant == "gated":
            self.held[b] = gap

    def choose(self, available, contexts=None, remaining=None):
        held = self.held
        lengths = super().choose(available, contexts, remaining)
        # gated: a probe's success keeps its short gap only if the choice then drafts
        for b, gap in held.items():
            if b < len(lengths) and lengths[b] == 0:
                self.gap[b] = min(2 * gap, 8 * self.probe_every)
        self.held = {}
        return lengths

    def select(self, rows):
        super().select(rows)
        self.held = {}
engine.AdaptiveLength = Patched
from bench.e2e import main
main(sys.argv[1:])

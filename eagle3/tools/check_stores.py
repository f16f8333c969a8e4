"""Compare two stage-02 stores row by row (e.g. the vLLM backend's against the HF one's),
and one store against transformers' own hidden states, neighbouring layers included.

    python -m eagle3.tools.check_stores WORK_VLLM WORK_HF [--samples 4] [--target TARGET]

Reads the two work directories' `02_hidden_states/` (and, with `--target`, runs the
target in transformers, float32, on the first samples); writes nothing. Prints one
`PASS`/`FAIL` line per check with its figure and exits 1 when any check fails.
scripts/gpu_check.sh and tests/e2e/test_real_target_e2e.py use it.

Checks (bf16 tolerance: two bf16 runs of the same model differ by rounding, a few percent
per token; neighbouring layers differ by far more, so an off-by-one fails):
    aux        per aux layer, the median per-token relative L2 error of store A against B
    final      the same for the final (normed) hidden state
    argmax     share of labelled positions where both stores hold the same target argmax
    layers     (with --target) store A's aux layer k is transformers' hidden_states[k]
               (median error within tolerance) and not hidden_states[k - 1] or [k + 1]
               (their error at least 5x larger and above 0.2)
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.artifacts.store import HiddenStateStore, label_positions
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.logs import setup_logging

log = logging.getLogger(__name__)

# Median, 90th percentile of the per-token relative error that still counts as "the same
# states in bf16": above what two bf16 backends of one model differ by (vLLM's CPU build against
# transformers on SmolLM2-135M, docs/results.md), far below what neighbouring layers differ by.
TOL_MEDIAN, TOL_P90 = 0.04, 0.08
MIN_ARGMAX_AGREEMENT = 0.95
NEIGHBOUR_FACTOR, NEIGHBOUR_MIN = 5.0, 0.2


@dataclass
class Check:
    name: str
    ok: bool
    figure: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.figure}"


def token_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error of a against b: [T, H] x [T, H] -> [T]."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def _close(err: torch.Tensor) -> bool:
    return err.median().item() < TOL_MEDIAN and err.quantile(0.9).item() < TOL_P90


def compare_stores(work_a: Path | str, work_b: Path | str, samples: int = 4, split: str = "train") -> list[Check]:
    """Row-by-row agreement of two stores of the same samples (aux per layer, final, argmax)."""
    a = HiddenStateStore.open(WorkDir(work_a), needed_by="check_stores")
    b = HiddenStateStore.open(WorkDir(work_b), needed_by="check_stores")
    if a.aux_layers != b.aux_layers:
        return [Check("aux layer ids", False, f"{a.aux_layers} vs {b.aux_layers}")]
    sa, sb = a.split(split), b.split(split)
    n = min(samples, len(sa), len(sb))
    errs = {k: [] for k in a.aux_layers}
    final, agree, total = [], 0, 0
    for i in range(n):
        x, y = sa[i], sb[i]
        if not torch.equal(x.input_ids, y.input_ids):
            return [Check("same samples", False, f"sample {i} has other token ids in the two stores")]
        H = x.final.shape[-1]
        ax = x.aux.view(x.num_tokens, -1, H)  # [T, A*H] -> [T, A, H]
        ay = y.aux.view(y.num_tokens, -1, H)
        for j, k in enumerate(a.aux_layers):
            errs[k].append(token_error(ax[:, j], ay[:, j]))
        final.append(token_error(x.final, y.final))
        m = label_positions(x.loss_mask, torch.tensor([0, x.num_tokens]))
        agree += int((x.target_argmax[m] == y.target_argmax[m]).sum())
        total += int(m.sum())
    checks = []
    for k, e in errs.items():
        e = torch.cat(e)
        checks.append(Check(f"aux layer {k}", _close(e), f"median rel err {e.median().item():.4f}, "
                                                          f"p90 {e.quantile(0.9).item():.4f} over {e.numel()} tokens"))
    f = torch.cat(final)
    checks.append(Check("final state", _close(f), f"median rel err {f.median().item():.4f}, "
                                                  f"p90 {f.quantile(0.9).item():.4f}"))
    share = agree / total if total else 0.0
    checks.append(Check("target argmax", share >= MIN_ARGMAX_AGREEMENT,
                        f"{100 * share:.1f}% of {total} labelled positions agree"))
    return checks


def check_layers(work: Path | str, target: Path | str, samples: int = 2, split: str = "train",
                 device: str = "cpu") -> list[Check]:
    """Stored aux layer k against transformers' hidden_states[k] and its neighbours k +- 1."""
    from transformers import AutoModelForCausalLM

    store = HiddenStateStore.open(WorkDir(work), needed_by="check_stores")
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).to(device).eval()
    sp = store.split(split)
    own = {k: [] for k in store.aux_layers}
    nb = {k: [] for k in store.aux_layers}
    for i in range(min(samples, len(sp))):
        s = sp[i]
        with torch.no_grad():
            hs = model(s.input_ids.long()[None].to(device), output_hidden_states=True).hidden_states
        H = s.final.shape[-1]
        aux = s.aux.view(s.num_tokens, -1, H)  # [T, A*H] -> [T, A, H]
        for j, k in enumerate(store.aux_layers):
            ref = [h[0].cpu() for h in (hs[k - 1], hs[k], hs[k + 1])]
            own[k].append(token_error(aux[:, j], ref[1]))
            nb[k].append(torch.minimum(token_error(aux[:, j], ref[0]), token_error(aux[:, j], ref[2])))
    checks = []
    for k in store.aux_layers:
        e, n = torch.cat(own[k]).median().item(), torch.cat(nb[k]).median().item()
        ok = e < TOL_MEDIAN and n > max(NEIGHBOUR_MIN, NEIGHBOUR_FACTOR * e)
        checks.append(Check(f"layer {k} is hidden_states[{k}]", ok,
                            f"median rel err {e:.4f} vs {n:.3f} to the nearer of layers {k - 1}/{k + 1}"))
    return checks


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description="Compare two stage-02 stores row by row (and against transformers).")
    p.add_argument("work_a", help="work directory of the store under test (e.g. the vLLM backend's)")
    p.add_argument("work_b", help="work directory of the reference store (e.g. the HF backend's)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--target", help="also check store A's layers against transformers' hidden_states")
    p.add_argument("--device", default="cpu", help="device for the transformers reference")
    a = p.parse_args(argv)
    setup_logging(logging.WARNING)
    checks = compare_stores(a.work_a, a.work_b, a.samples)
    if a.target:
        checks += check_layers(a.work_a, a.target, min(a.samples, 2), device=a.device)
    for c in checks:
        sys.stdout.write(c.line() + "\n")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Target-side parity: SGLang's own target class captures the aux states stage 02 stored.

    capture_parity([CaptureCase(NAME, WORK), ...], samples=4) -> {NAME: report}   (tests/stages/test_sglang_capture.py)

Reads stage 02's store of a work dir (eagle3/artifacts/store/reader.py `HiddenStateStore`,
its aux layer ids and the target folder in its record) and runs SGLang's target class for
that architecture on the target's weights in the SGLang worker (eagle3/tools/parity/
sglang_side.py `capture`), with the layers SGLang captures for the drafter config stage 05
writes: the nested ids of eagle3/serving/engine_rules.py `aux_layer_config` (or a case's
`nested_ids`, to try another config) handed to the target's own `set_eagle3_layers_to_capture`. Each
captured layer is compared with the store's, token by token, with eagle3/tools/check_stores.py's
tolerance (median and 90th percentile of the per-token relative error; the store is bf16 or
fp8, SGLang's run float32), and so is the final normed state. Writes nothing.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from eagle3.artifacts.manifest import read_record
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.serving.engine_rules import aux_layer_config
from eagle3.tools.check_stores import TOL_MEDIAN, TOL_P90, token_error
from eagle3.tools.parity import protocol
from eagle3.tools.parity.check import run_worker


@dataclass
class CaptureCase:
    """A work dir whose stage 02 store SGLang's target must reproduce, with one drafter config's
    nested ids (None: what stage 05 writes for the store's layers)."""

    name: str
    work_dir: Path | str
    nested_ids: Sequence[int] | None = None
    target: str | None = None  # default: the target folder stage 02's record names


def capture_parity(cases: Sequence[CaptureCase], *, samples: int = 4, split: str = "train",
                   sglang: str | None = None) -> dict[str, dict[str, Any]]:
    """SGLang's capture of each case's first `samples` samples against its store, in one SGLang
    worker for all cases: {case name: report}."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="eagle3-capture-") as tmp:
        work = Path(tmp)
        jobs, stored = {}, {}
        for i, case in enumerate(cases):
            workdir = WorkDir(case.work_dir)
            store = HiddenStateStore.open(workdir, needed_by="the SGLang capture parity")
            record = read_record(workdir, "extract", needed_by="the SGLang capture parity")
            layers = [int(k) for k in store.aux_layers]
            view = store.split(split)
            rows = [view[j] for j in range(min(samples, len(view)))]
            save_file({f"ids.{j}": r.input_ids.long().contiguous() for j, r in enumerate(rows)},
                      str(work / f"ids-{i}.safetensors"))
            nested = list(case.nested_ids) if case.nested_ids is not None else \
                aux_layer_config(layers)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            jobs[case.name] = {"name": case.name, "target": str(Path(case.target or record.target_model).resolve()),
                               "nested_ids": nested, "samples": str(work / f"ids-{i}.safetensors"),
                               "out": str(work / f"capture-{i}")}
            stored[case.name] = (rows, layers, str(workdir.root))
        run_worker("sglang", {"engine": "sglang", "captures": list(jobs.values())}, work, sglang)
        results = {name: protocol.read_result(job["out"]) for name, job in jobs.items()}
    return {name: _judge(*stored[name][:2], jobs[name], *results[name], record_dir=stored[name][2]) for name in jobs}


def _judge(rows, layers: list[int], job: dict[str, Any], tensors: dict[str, torch.Tensor], facts: dict[str, Any],
           record_dir: str) -> dict[str, Any]:
    report: dict[str, Any] = {"work_dir": record_dir, "target": job["target"], "trained_layers": layers,
                              "nested_ids": job["nested_ids"], "samples": len(rows),
                              "tokens": sum(r.num_tokens for r in rows), "versions": facts.get("versions"),
                              "error": facts.get("error"), "architecture": facts.get("architecture"),
                              "captured_layers": facts.get("layers_to_capture"),
                              "tolerance": {"median": TOL_MEDIAN, "p90": TOL_P90}, "layers": [], "ok": False}
    if facts.get("error"):
        return report
    H = rows[0].final.shape[-1]
    stored = torch.cat([r.aux.float().view(r.num_tokens, -1, H) for r in rows])  # [T_all, A, H]
    for j, layer in enumerate(layers):
        got = tensors.get(f"captured.{j}")
        captured = facts.get("layers_to_capture") or []
        entry: dict[str, Any] = {"layer": layer, "captured_as": captured[j] if j < len(captured) else None}
        if got is None:
            entry.update(ok=False, note="SGLang captured fewer layers than the store holds")
        else:
            err = token_error(got, stored[:, j])
            entry.update(median=err.median().item(), p90=err.quantile(0.9).item())
            entry["ok"] = entry["median"] < TOL_MEDIAN and entry["p90"] < TOL_P90
        report["layers"].append(entry)
    err = token_error(tensors["final"], torch.cat([r.final.float() for r in rows]))
    report["final"] = {"median": err.median().item(), "p90": err.quantile(0.9).item()}
    report["final"]["ok"] = report["final"]["median"] < TOL_MEDIAN and report["final"]["p90"] < TOL_P90
    report["ok"] = all(e["ok"] for e in report["layers"]) and report["final"]["ok"]
    return report


def format_capture(report: dict[str, Any]) -> str:
    out = [f"SGLang {(report.get('versions') or {}).get('sglang')} {report.get('architecture')} on {report['target']}: "
           f"{report['samples']} samples, {report['tokens']} tokens; nested ids {report['nested_ids']} -> captures "
           f"{report.get('captured_layers')}, store holds {report['trained_layers']}"]
    if report.get("error"):
        out.append(f"FAIL: SGLang's target did not run: {report['error']['message']} at {report['error'].get('at')}")
        return "\n".join(out)
    for e in report["layers"]:
        out.append(f"{'PASS' if e['ok'] else 'FAIL'} layer {e['layer']}: median {e.get('median', float('nan')):.4f}, "
                   f"p90 {e.get('p90', float('nan')):.4f} (tolerance {TOL_MEDIAN}, {TOL_P90})")
    f = report["final"]
    out.append(f"{'PASS' if f['ok'] else 'FAIL'} final: median {f['median']:.4f}, p90 {f['p90']:.4f}")
    return "\n".join(out)

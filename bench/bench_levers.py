"""Data-efficiency levers, each served: same data, same budget, one setting changed.

    python bench/bench_levers.py --work-dir W [--config configs/smollm2-135m.yaml] [--target-model M]
                                 [--levers baseline,loss-all,...] [--num-prompts N] [--temperature T]

W is a work dir where stages 00-03 ran under --config (the SmolLM2 demo's by default).
For each lever, a sibling work dir W-levers/<lever>/ takes W's stages 00-02 as symlinks
(and stage 03 too, unless the lever changes the draft vocabulary), then runs stage 04
with the config's budget plus the lever's options, stage 05, and stage 06 greedy on the
config's held-out prompts (no untrained baseline, no timing: acceptance only; the
`select-served` levers first have stage 06 choose among stage 04's kept checkpoints on stage
01's eval split, and the report names the step exported). A lever
whose stage 06 results exist is not rerun, so an interrupted bench resumes. Stage 06 serves
greedy unless --temperature says otherwise (the `loss-*` levers target the acceptance under
sampling; what vLLM's greedy drafts measure at a temperature: docs/LEVERS.md, "The loss"); a
temperature other than 0 keeps its lever work dirs apart (W-levers-t<T>), so greedy and
sampled results never mix.

Prints per lever: served acceptance length with its 95% interval and per position,
stage 04's held-out expected acceptance of the checkpoint exported (greedy, and under
sampling where the run reports it: docs/CONVENTIONS.md §5), the difference to the
baseline lever with its paired 95% interval (the same prompts resampled together for both drafters), and
whether it lies beyond the baseline's own 95% interval (the rule for adopting a lever
as a default). Every lever costs one stage 04-06 run (the demo's: ~5 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_pairs import paired_interval, per_prompt, verdict as verdict_of  # noqa: E402

# lever -> (stage 03 options, stage 04 options); everything else is the config's.
LEVERS: dict[str, tuple[list[str], list[str]]] = {
    "baseline": ([], []),
    "loss-all": ([], ["--loss-on", "all"]),
    "aux-noise-0.1": ([], ["--aux-noise", "0.1"]),
    "init-last-layer": ([], ["--init-layer", "-1"]),
    "init-head": ([], ["--init-head"]),
    "init-tail": ([], ["--init-layer", "-1", "--init-head"]),
    "ttt-5": ([], ["--ttt-steps", "5"]),
    "step-decay-1.0": ([], ["--step-decay", "1.0"]),
    "step-decay-0.6": ([], ["--step-decay", "0.6"]),
    "vocab-8192": (["--draft-vocab-size", "8192"], []),
    "vocab-2048": (["--draft-vocab-size", "2048"], []),
    "lr-min-0": ([], ["--min-lr-ratio", "0.0"]),
    "steps-300": ([], ["--max-steps", "300"]),
    "loss-all+init-tail": ([], ["--loss-on", "all", "--init-layer", "-1", "--init-head"]),
    # a second training seed, to see a lever's lift next to the run-to-run spread
    "baseline-seed1": ([], ["--seed", "1"]),
    "baseline-seed2": ([], ["--seed", "2"]),  # the third seed, beside bench_quality's --seed 2 (docs/LEVERS.md)
    "init-tail-seed1": ([], ["--init-layer", "-1", "--init-head", "--seed", "1"]),
    # EAGLE 3.1's two norms (fc_norm, norm_output; +7.2% mean acceptance on Qwen3-8B, speculators #610)
    "eagle3.1": ([], ["--drafter-shape", "eagle3.1"]),
    "eagle3.1-seed1": ([], ["--drafter-shape", "eagle3.1", "--seed", "1"]),
    # losses that target acceptance (docs/LEVERS.md, "The loss"), each on two seeds; kl is the baseline's
    "loss-tv": ([], ["--loss", "tv"]),
    "loss-tv-seed1": ([], ["--loss", "tv", "--seed", "1"]),
    "loss-lk-alpha": ([], ["--loss", "lk_alpha"]),
    "loss-lk-alpha-seed1": ([], ["--loss", "lk_alpha", "--seed", "1"]),
    "loss-lk-lambda": ([], ["--loss", "lk_lambda"]),
    "loss-lk-lambda-seed1": ([], ["--loss", "lk_lambda", "--seed", "1"]),
    "loss-kl0.1-tv0.9": ([], ["--loss", "kl:0.1,tv:0.9"]),
    "loss-kl0.1-tv0.9-seed1": ([], ["--loss", "kl:0.1,tv:0.9", "--seed", "1"]),
    # the loss closest to a lift (the mix) on EAGLE 3.1's shape: the best combination of a loss and a shape
    "loss-kl0.1-tv0.9+eagle3.1": ([], ["--loss", "kl:0.1,tv:0.9", "--drafter-shape", "eagle3.1"]),
    "loss-kl0.1-tv0.9+eagle3.1-seed1": ([], ["--loss", "kl:0.1,tv:0.9", "--drafter-shape", "eagle3.1", "--seed", "1"]),
    # the checkpoint the engine serves best: stage 04 keeps its 5 evaluated checkpoints (steps 50-250), stage 06
    # serves each on stage 01's eval split and exports the best; it is then measured on the held-out prompts
    "select-served": ([], ["--keep-evaluated", "5"]),
    "select-served-seed1": ([], ["--keep-evaluated", "5", "--seed", "1"]),
}
# lever -> stage 06 options beyond the bench's own (acceptance only, the config's prompts)
STAGE06_OPTIONS: dict[str, list[str]] = {
    "select-served": ["--select-checkpoint", "--selection-prompts", "eval-split"],
    "select-served-seed1": ["--select-checkpoint", "--selection-prompts", "eval-split"],
}
SHARED = ("00_generate", "01_dataset", "02_hidden_states")


def script(number: str) -> Path:
    return next(ROOT.glob(f"{number}_*.py"))


def run_lever(name: str, base: Path, out: Path, config: Path, target: str | None, num_prompts: int | None,
              extra04: list[str], temperature: float = 0.0) -> tuple[dict, dict, float]:
    """Stages (03,) 04, 05, 06 of one lever -> (stage 06 results, stage 04 manifest, stage 04 seconds)."""
    opts03, opts04 = LEVERS[name]
    workdir = out / name
    workdir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED + (() if opts03 else ("03_vocab",)):
        link = workdir / stage
        if (base / stage).exists() and not link.exists():
            link.symlink_to((base / stage).resolve(), target_is_directory=True)
    results = workdir / "06_evaluate" / "results.json"
    timing = workdir / "bench_levers_04_seconds.txt"
    common = ["--config", str(config), "--work-dir", str(workdir)]
    tm = ["--target-model", target] if target else []
    if not results.is_file():
        steps = ([("03", opts03)] if opts03 else []) + [("04", opts04 + extra04), ("05", []),
                 ("06", ["--temperature", str(temperature), "--no-baseline-untrained", "--timing-prompts", "0",
                         *(["--num-prompts", str(num_prompts)] if num_prompts else []),
                         *STAGE06_OPTIONS.get(name, [])])]
        for number, opts in steps:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(script(number)), *common, *([] if number == "03" else tm), *opts],
                           cwd=ROOT, check=True)
            if number == "04":
                timing.write_text(f"{time.perf_counter() - t0:.1f}\n")
    train = json.loads((workdir / "04_train" / "manifest.json").read_text())
    seconds = float(timing.read_text()) if timing.is_file() else float("nan")
    return json.loads(results.read_text()), train, seconds


def held_out_of_export(workdir: Path, m04: dict) -> tuple[float, float]:
    """Stage 04's held-out expected accept length (greedy, sampled) of the checkpoint exported:
    the best evaluation's, or, where stage 06 chose by serving (selection.json), the chosen step's."""
    chosen = workdir / "06_evaluate" / "selection.json"
    if not chosen.is_file():
        best = m04["record"].get("best_eval") or {}
        return m04["record"]["best_expected_accept_length"], best.get("sample_accept_length", float("nan"))
    step = json.loads(chosen.read_text())["chosen_step"]
    for line in (workdir / "04_train" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "eval" and row.get("step") == step:
            return row["expected_accept_length"], row.get("sample_accept_length", float("nan"))
    raise SystemExit(f"{workdir}/04_train/metrics.jsonl has no evaluation at step {step}, the step exported")


def report(rows: list[tuple[str, dict, dict, float]], out_dir: Path, temperature: float = 0.0) -> list[str]:
    out = [f"{'lever':24s}{'served L (95%)':>16s}  {'per position':16s}{'held-out est.':>14s}{'sampled':>8s}"
           f"{'vs baseline (paired 95%)':>29s}{'04 s':>6s}  verdict"]
    base = next((r for n, r, _, _ in rows if n == "baseline"), None)
    hi = base["acceptance_length"] + base["acceptance_length_ci95"] if base else None
    lo = base["acceptance_length"] - base["acceptance_length_ci95"] if base else None
    for name, r, m04, secs in rows:
        L, ci = r["acceptance_length"], r["acceptance_length_ci95"]
        per = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
        est, sampled = held_out_of_export(out_dir / name, m04)
        if base is None or name == "baseline":
            delta, verdict = "", "" if base is None else f"interval [{lo:.3f}, {hi:.3f}]"
        else:
            d_lo, d_hi = paired_interval(per_prompt(out_dir / name, temperature),
                                         per_prompt(out_dir / "baseline", temperature))
            delta = f"{L - base['acceptance_length']:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}]"
            verdict = "ABOVE the baseline's interval" if L > hi else (
                "below the baseline's interval" if L < lo else "inside the baseline's interval")
            verdict += "; paired: " + verdict_of(d_lo, d_hi)
        chosen = out_dir / name / "06_evaluate" / "selection.json"
        if chosen.is_file():
            verdict += f"; exported step {json.loads(chosen.read_text())['chosen_step']}"
        out.append(f"{name:24s}{f'{L:.3f} ±{ci:.3f}':>16s}  {per:16s}{est:>14.3f}{sampled:>8.3f}{delta:>29s}"
                   f"{secs:>6.0f}  {verdict}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="work dir with stages 00-03 done under --config")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml")
    ap.add_argument("--target-model", help="override the config's target_model (the one stage 02 read)")
    ap.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, of: {', '.join(LEVERS)}")
    ap.add_argument("--out", type=Path, help="where the lever work dirs go (default: W-levers, or W-levers-t<T> "
                                             "with --temperature T other than 0)")
    ap.add_argument("--num-prompts", type=int, help="serve only the first N held-out prompts")
    ap.add_argument("--stage04", default="", help="extra stage 04 options for every lever (e.g. '--max-steps 300')")
    ap.add_argument("--temperature", type=float, default=0.0, help="stage 06's sampling temperature (0: greedy; "
                                                                 "vLLM still drafts greedily: docs/LEVERS.md, "
                                                                 "\"The loss\")")
    a = ap.parse_args()
    names = [n for n in a.levers.split(",") if n]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown lever(s) {unknown}; choose from {list(LEVERS)}")
    base = a.work_dir.resolve()
    if not (base / "03_vocab" / "manifest.json").is_file():
        raise SystemExit(f"{base}/03_vocab/manifest.json is missing: run stages 00-03 of {a.config} in {base} first.")
    suffix = "-levers" if a.temperature == 0 else f"-levers-t{a.temperature:g}"
    out = (a.out or base.with_name(base.name + suffix)).resolve()
    rows = []
    for name in names:
        r, m04, secs = run_lever(name, base, out, a.config.resolve(), a.target_model, a.num_prompts, a.stage04.split(),
                                 a.temperature)
        rows.append((name, r, m04, secs))
        print("\n".join(report(rows, out, a.temperature)) + "\n", flush=True)
    served = "greedy" if a.temperature == 0 else f"temperature {a.temperature:g}"
    print(f"== levers on {base} ({a.config}), {served}, K = {rows[0][1]['num_speculative_tokens']}, "
          f"{rows[0][1]['prompts']['count']} held-out prompts; work dirs under {out}")
    print("\n".join(report(rows, out, a.temperature)))


if __name__ == "__main__":
    main()

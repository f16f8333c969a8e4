"""Windows of a disk budget against the whole store: same data, same steps, both served.

    python bench/bench_windows.py --work-dir W [--config configs/smollm2-135m.yaml]
                                  [--budget-fraction 0.25 | --disk-budget 221MB]
                                  [--variants epochs,passes] [--max-steps 250]

W is a work dir where the whole pipeline ran under --config (`bash scripts/demo.sh`
builds work/smollm2-135m): its stage 06 results are the whole-store run. Each variant
gets a sibling work dir W-windows/<variant>/ with W's stages 00, 01 and 03 as symlinks and
a store of its own, built by the one-box window loop (`python -m eagle3.tools.window_loop`)
under a disk budget of a fraction of W's store (a quarter by default); then stages 05 and
06, greedy on the config's held-out prompts (no untrained floor, no timing: acceptance
only). Variants differ only in how the run passes over its data several times:

    epochs   every window trained --epochs E times before the next (one extraction pass);
    passes   two extraction passes, each window trained E/2 times per pass.

E is the smallest number of passes whose steps reach --max-steps (the config's, 250 for
the demo), so each variant trains exactly as many steps as W's run, under one schedule.

Prints per variant: served acceptance length with its 95% interval, the difference to
the whole-store run with its paired 95% interval (the same prompts resampled together),
whether it lies inside the whole-store run's interval, the store's peak bytes on disk
over the whole run (sampled every 0.2 s, held-out split included) against the budget and
the budget plus one file, the rounds (= engine starts on one box) and the seconds of
extraction and of training. A variant whose stage 06 results exist is not rerun.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_pairs import paired_interval, per_prompt, verdict as verdict_of  # noqa: E402

from eagle3.artifacts import windows  # noqa: E402
from eagle3.artifacts.dataset import load_split  # noqa: E402
from eagle3.artifacts.workdir import SPLITS, WorkDir  # noqa: E402
from eagle3.core.config import build_config  # noqa: E402
from eagle3.stages.configs import STAGE_CONFIGS  # noqa: E402
from eagle3.stages.s02_extract.config import ExtractConfig  # noqa: E402
from eagle3.stages.s04_train.config import TrainConfig  # noqa: E402
from eagle3.stages.s04_train.data import Batching  # noqa: E402
from eagle3.stages.s04_train.windows import RoundSchedule, trainable_samples  # noqa: E402
from eagle3.target.info import read_target_info  # noqa: E402
from eagle3.tools.window_loop import PeakDisk  # noqa: E402

SHARED = ("00_generate", "01_dataset", "03_vocab")
ROUND_LINE = re.compile(r"round (\d+)/(\d+) .*?extract ([0-9.]+) s, train ([0-9.]+) s")


def script(number: str) -> Path:
    return next(ROOT.glob(f"{number}_*.py"))


def store_files(store_dir: Path) -> list[int]:
    return [p.stat().st_size for p in store_dir.rglob("*.safetensors")]


def plan_steps(config: Path, workdir: Path, budget: str, passes: int, epochs: int) -> int:
    """Steps the windowed run will train with these passes and epochs: stage 02's window
    plan and stage 04's own round schedule, from stage 01's lengths."""
    ex = build_config(ExtractConfig, "extract", str(config), {"work_dir": str(workdir)}, sections=STAGE_CONFIGS)
    tr = build_config(TrainConfig, "train", str(config), {"work_dir": str(workdir), "epochs": epochs},
                      sections=STAGE_CONFIGS)
    w = WorkDir(workdir)
    info = read_target_info(ex.target_model, ex.trust_remote_code)
    aux = ex.aux_layers if ex.aux_layers is not None else info.default_aux_layers()
    lengths = {s: [int(n) for n in load_split(w.dataset(s))["num_tokens"]] for s in SPLITS}
    plan = windows.make_plan(lengths["train"], lengths["eval"], disk_budget=windows.parse_bytes(budget),
                             seed=ex.window_seed, passes=passes, windows_in_budget=ex.windows_in_budget,
                             spf=ex.samples_per_file, H=info.hidden_size, A=len(aux), dtype=ex.store_dtype)
    train_lengths, trainable = trainable_samples(w, tr.max_seq_len, assistant_only=tr.loss_on == "assistant")
    batching = Batching(tr.batch_tokens, tr.max_seq_len, tr.seed, packed=tr.packing)
    return RoundSchedule(plan, train_lengths, trainable, batching, rank=0, world=1, grad_accum=tr.grad_accum,
                         epochs=epochs).total


def run_variant(name: str, base: Path, workdir: Path, config: Path, budget: str, passes: int, epochs: int,
                max_steps: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:
        link = workdir / stage
        if not link.exists():
            link.symlink_to((base / stage).resolve(), target_is_directory=True)
    results = workdir / "06_evaluate" / "results.json"
    record = workdir / "bench_windows.json"
    common = ["--config", str(config), "--work-dir", str(workdir)]
    if not results.is_file():
        store = workdir / "02_hidden_states"
        t0 = time.perf_counter()
        with PeakDisk([store]) as peak:
            subprocess.run([sys.executable, "-m", "eagle3.tools.window_loop", *common, "--disk-budget", budget,
                            "--extract-args", f"--extraction-passes {passes}",
                            "--train-args", f"--epochs {epochs} --max-steps {max_steps}"], cwd=ROOT, check=True)
        loop_s = time.perf_counter() - t0
        rounds = [m.groups() for m in ROUND_LINE.finditer((workdir / "logs" / "window_loop.log").read_text())]
        record.write_text(json.dumps({
            "peak_bytes": peak.peak, "loop_s": loop_s, "rounds": len(rounds),
            "extract_s": sum(float(r[2]) for r in rounds), "train_s": sum(float(r[3]) for r in rounds),
            "largest_file": max(store_files(store) or [0])}) + "\n")
        for number, opts in (("05", []), ("06", ["--temperature", "0.0", "--no-baseline-untrained",
                                                 "--timing-prompts", "0"])):
            subprocess.run([sys.executable, str(script(number)), *common, *opts], cwd=ROOT, check=True)
    out = json.loads(record.read_text())
    out["results"] = json.loads(results.read_text())
    out["train"] = json.loads((workdir / "04_train" / "manifest.json").read_text())
    return out


def report(base: Path, whole: dict, rows: list[tuple[str, int, int, dict]], out: Path, budget: int,
           whole_store: int, whole_file: int) -> list[str]:
    L0, ci0 = whole["acceptance_length"], whole["acceptance_length_ci95"]
    lines = [f"whole store: {windows.human(whole_store)} on disk ({base / '02_hidden_states'}), served "
             f"{L0:.3f} ±{ci0:.3f} greedy, interval [{L0 - ci0:.3f}, {L0 + ci0:.3f}]; budget {windows.human(budget)} "
             f"({budget / whole_store:.0%} of it)",
             f"{'variant':10s}{'passes x epochs':>16s}{'served L (95%)':>16s}{'vs whole (paired 95%)':>26s}"
             f"{'peak disk':>11s}{'<= budget + file':>18s}{'rounds':>8s}{'extract s':>10s}{'train s':>9s}  verdict"]
    for name, passes, epochs, r in rows:
        res = r["results"]
        L, ci = res["acceptance_length"], res["acceptance_length_ci95"]
        lo, hi = paired_interval(per_prompt(out / name), per_prompt(base))
        inside = "inside" if L0 - ci0 <= L <= L0 + ci0 else "OUTSIDE"
        fits = r["peak_bytes"] <= budget + max(r["largest_file"], whole_file)
        lines.append(f"{name:10s}{f'{passes} x {epochs}':>16s}{f'{L:.3f} ±{ci:.3f}':>16s}"
                     f"{f'{L - L0:+.3f} [{lo:+.3f}, {hi:+.3f}]':>26s}{windows.human(r['peak_bytes']):>11s}"
                     f"{'yes' if fits else 'NO':>18s}{r['rounds']:>8d}{r['extract_s']:>10.0f}{r['train_s']:>9.0f}  "
                     f"{inside} the whole store's interval; paired: {verdict_of(lo, hi)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="work dir where stages 00-06 ran under --config")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml")
    ap.add_argument("--budget-fraction", type=float, default=0.25, help="the disk budget as a share of W's store")
    ap.add_argument("--disk-budget", help="the disk budget in bytes or with a unit (overrides --budget-fraction)")
    ap.add_argument("--variants", default="epochs,passes", help="comma-separated, of: epochs, passes")
    ap.add_argument("--max-steps", type=int, help="steps of every variant (default: the config's train.max_steps, as W's run)")
    ap.add_argument("--out", type=Path, help="where the variants' work dirs go (default: W-windows)")
    a = ap.parse_args()
    base = a.work_dir.resolve()
    whole_path = base / "06_evaluate" / "results.json"
    if not (base / "03_vocab" / "manifest.json").is_file():
        raise SystemExit(f"{base}/03_vocab/manifest.json is missing: run the whole pipeline in {base} first "
                         f"(bash scripts/demo.sh).")
    store = base / "02_hidden_states"
    whole_store = windows.dir_bytes(store)
    budget = windows.parse_bytes(a.disk_budget) if a.disk_budget else int(whole_store * a.budget_fraction)
    max_steps = a.max_steps or build_config(TrainConfig, "train", str(a.config), {"work_dir": str(base)},
                                            sections=STAGE_CONFIGS).max_steps
    if not max_steps:
        raise SystemExit(f"{a.config} sets no train.max_steps: give --max-steps (the whole-store run's steps)")
    out = (a.out or base.with_name(base.name + "-windows")).resolve()
    config = a.config.resolve()
    rows = []
    for name in [v for v in a.variants.split(",") if v]:
        if name not in ("epochs", "passes"):
            raise SystemExit(f"unknown variant {name!r}: choose from epochs, passes")
        passes = 1 if name == "epochs" else 2
        epochs = 1
        while plan_steps(config, base, str(budget), passes, epochs) < max_steps:
            epochs += 1
        rows.append((name, passes, epochs, run_variant(name, base, out / name, config, str(budget), passes, epochs,
                                                       max_steps)))
        if not whole_path.is_file():
            print(f"{name}: done; {whole_path} is not there yet: rerun this command once stage 06 ran in {base} "
                  f"(finished variants are not rerun)", flush=True)
            continue
        print("\n".join(report(base, json.loads(whole_path.read_text()), rows, out, budget, whole_store,
                               max(store_files(store) or [0]))) + "\n", flush=True)
    print(f"== windows against the whole store on {base} ({a.config}), {max_steps} steps each, greedy; "
          f"work dirs under {out}")


if __name__ == "__main__":
    main()

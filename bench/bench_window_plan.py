"""The window plan of the reference recipe: how many windows, how much disk, how many engine starts.

    python bench/bench_window_plan.py [--tokens 1.2e9] [--sample-tokens 2048] [--budget 2TB] [--held-out 1200]

Plans (eagle3/artifacts/windows.py, the function stage 02 runs) a train split of `tokens / sample_tokens`
samples of `sample_tokens` tokens each at Kimi-K2.5's width (hidden 7168, 3 aux layers) in both store
encodings, with 256 samples per file (stage 02's default), and prints one line per encoding: windows,
tokens per window, held-out bytes, the planned peak, and the engine starts of the one-box loop (one per
round). Uniform sample lengths are the assumption; a real stage 01 split is planned by
`python -m eagle3.tools.diagnose store-size --config C --disk-budget 2TB`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.artifacts import windows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1.2e9)
    ap.add_argument("--sample-tokens", type=int, default=2048)
    ap.add_argument("--budget", default="2TB")
    ap.add_argument("--held-out", type=int, default=1200, help="held-out samples (kept on disk all run)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--passes", type=int, default=1)
    a = ap.parse_args()
    n = int(a.tokens // a.sample_tokens)
    print(f"{n:,} train samples of {a.sample_tokens} tokens ({n * a.sample_tokens / 1e9:.2f} B tokens), "
          f"{a.held_out:,} held-out samples, budget {a.budget}, hidden {a.hidden}, 3 aux layers, 256 samples/file")
    print(f"{'encoding':9s}{'B/token':>9s}{'whole store':>13s}{'windows':>9s}{'tokens/window':>16s}"
          f"{'held-out':>11s}{'peak':>11s}{'engine starts':>15s}{'plan s':>8s}")
    for dtype in ("bf16", "fp8"):
        t0 = time.perf_counter()
        plan = windows.make_plan([a.sample_tokens] * n, [a.sample_tokens] * a.held_out,
                                 disk_budget=windows.parse_bytes(a.budget), seed=0, passes=a.passes,
                                 windows_in_budget=1, spf=256, H=a.hidden, A=3, dtype=dtype)
        dt = time.perf_counter() - t0
        whole = plan.bytes_per_token * n * a.sample_tokens
        toks = max(w["tokens"] for w in plan.windows)
        print(f"{dtype:9s}{plan.bytes_per_token:>9,}{windows.human(whole):>13s}{plan.num_windows:>9d}{toks:>16,}"
              f"{windows.human(plan.held_out_bytes):>11s}{windows.human(plan.peak_bytes):>11s}{plan.rounds:>15d}"
              f"{dt:>8.1f}")


if __name__ == "__main__":
    main()

"""Benchmark stage 01: conversations/s and tokens/s, one process vs parallel workers.

    python bench/bench_prepare.py [--conversations 10000] [--workers 2]

Generates a synthetic multi-turn chat set (eagle3/demo/synthetic_chats.py), builds the
tiny Llama target's tokenizer, and runs `prepare_dataset` twice in this process
on the same file: once with one worker, once with `--workers`. Prints the figures
and the speed-up; reading, tokenizing, masking and writing Arrow are all included.
"""
import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.core.logs import setup_logging  # noqa: E402
from eagle3.artifacts.manifest import record_of  # noqa: E402
from eagle3.stages.s01_prepare.run import prepare_dataset
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.demo.synthetic_chats import write_jsonl  # noqa: E402
from eagle3.demo.tiny import build_tiny_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    setup_logging(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = build_tiny_target("llama", tmp / "target")
        data = write_jsonl(tmp / "chats.jsonl", a.conversations, seed=1)
        rows = []
        for workers in (1, a.workers):
            t0 = time.perf_counter()
            m = prepare_dataset(PrepareConfig(work_dir=tmp / f"w{workers}", target_model=str(target),
                                              data=[str(data)], max_length=4096, num_workers=workers))
            dt = time.perf_counter() - t0
            convs = sum(record_of(m).samples.values())
            tokens = sum(record_of(m).tokens.values())
            rows.append((workers, dt, convs / dt, tokens / dt))
            print(f"workers={workers}: {convs} conversations, {tokens} tokens in {dt:.1f} s -> "
                  f"{convs / dt:,.0f} conv/s, {tokens / dt:,.0f} tokens/s")
        print(f"speed-up with {a.workers} workers: {rows[1][1] and rows[0][1] / rows[1][1]:.2f}x "
              f"(on {__import__('os').cpu_count()} CPUs)")


if __name__ == "__main__":
    main()

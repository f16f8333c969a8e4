"""Benchmark of stage 02 on vLLM's CPU build: extraction cost, bytes per token, read throughput.

    python bench/bench_extract.py                       # tiny Llama, demo chats, 5 passes
    python bench/bench_extract.py --kind deepseek_v3 --passes 3

In one run, on the same prompts (stage 01 on the shipped demo chats, files of
`--samples-per-file` prompts, one `generate` call per file in both cases):
  1. plain vLLM prefill: `max_tokens=1`, no extraction (the baseline);
  2. stage 02's vLLM extraction: the extract_hidden_states method, the project's KV
     connector writing into the store, then each file finalized (norm, argmax,
     checksum, rename), exactly as `02_extract_hidden_states.py` does;
  3. the same extraction with files only renamed, not finalized: the cost of
     vLLM's extraction and the connector alone;
and prints tokens/s, the time ratios to plain prefill (goal: extraction <= 1.15x),
bytes per token on disk, and the store's read throughput into
training-shaped batches (zero-copy samples, padded with `eagle3.artifacts.store.collate`).
Both engines are started once (startup not timed) and passes alternate between
them, so load from other processes hits both alike; figures are medians.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.core.logs import setup_logging  # noqa: E402

log = logging.getLogger("bench_extract")


def prepare(work: Path, kind: str) -> tuple[Path, Path]:
    from eagle3.stages.s01_prepare.run import prepare_dataset
    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.demo.tiny import build_tiny_target

    target = build_tiny_target(kind, work / "targets" / kind)
    workdir = work / f"wd-{kind}"
    prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(target), data=[str(ROOT / "data/demo_chats.jsonl")],
                                  max_length=512, eval_fraction=0.1, num_workers=1))
    return target, workdir


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plain_engine(cfg, p, files):
    """A plain vLLM engine (no extraction) and a function running all files' prompts through it."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3.stages.s02_extract.inputs import load_split
    from eagle3.engines.vllm_engine import engine_kwargs
    from eagle3.stages.s02_extract.vllm_backend import extraction_engine

    engine = cfg.engine_config(model=p.info.source, tensor_parallel_size=1, max_model_len=p.max_tokens + 1)
    llm = LLM(**engine_kwargs(extraction_engine(engine, cfg.batch_tokens)))
    splits = {s: load_split(p.workdir, s) for s in ("train", "eval")}
    chunks = [[TokensPrompt(prompt_token_ids=[int(t) for t in x])
               for x in splits[f.split][f.first:f.first + f.count]["input_ids"]] for f in files]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def one_pass():  # one generate call per file, as the extraction makes
        for c in chunks:
            llm.generate(c, sp, use_tqdm=False)

    return llm, one_pass


@contextlib.contextmanager
def finalize_skipped():
    """Stage 02 with each file only renamed, not finalized (no norm, argmax, checksum):
    isolates the cost of vLLM's extraction + the KV connector from the store's
    post-processing, which on a GPU box overlaps the forward on idle CPU cores and GPU 0."""
    from eagle3.artifacts import store

    real = store.finalize_file
    store.finalize_file = lambda partial, final_path, **kw: os.replace(partial, final_path)
    try:
        yield
    finally:
        store.finalize_file = real


def compare(cfg, p, files, passes: int) -> dict[str, list[float]]:
    """Seconds per pass of plain prefill, extraction, and extraction without finalize, interleaved.

    Both engines stay up (the idle one blocks on its queue), and passes alternate,
    so load from other processes on a shared machine hits all alike.
    """
    from eagle3.stages.s02_extract.engine import load_engine
    from eagle3.stages.s02_extract.write import write_files

    llm, plain_pass = plain_engine(cfg, p, files)
    backend, head = load_engine(cfg, p)

    def extract_pass():
        write_files(p, backend, head, files, lambda n: None)

    def engine_only_pass():
        with finalize_skipped():
            write_files(p, backend, head, files, lambda n: None)

    try:
        plain_pass()  # warm-up both
        write_files(p, backend, head, files[:1], lambda n: None)
        t: dict[str, list[float]] = {"plain": [], "extract": [], "engine_only": []}
        for _ in range(passes):
            t["plain"].append(_timed(plain_pass))
            t["engine_only"].append(_timed(engine_only_pass))
            t["extract"].append(_timed(extract_pass))  # last: leaves complete files behind
            log.info("pass: plain %.2fs, extraction %.2fs, extraction without finalize %.2fs",
                     t["plain"][-1], t["extract"][-1], t["engine_only"][-1])
        return t
    finally:
        backend.close()
        llm.llm_engine.engine_core.shutdown()


def read_throughput(workdir: Path, batch_tokens: int, epochs: int = 3) -> tuple[float, int]:
    """Tokens/s from the store into padded [B, T, 3H] batches, shuffled order; and the token count."""
    import random

    from eagle3.artifacts.store import HiddenStateStore, collate
    from eagle3.artifacts.workdir import WorkDir

    split = HiddenStateStore.open(WorkDir(workdir), needed_by="bench").split("train")
    lengths = split.lengths()
    order = list(range(len(split)))
    n_tok, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        random.Random(epoch).shuffle(order)
        batch, longest = [], 0
        for i in order + [None]:
            if i is None or (batch and max(longest, lengths[i]) * (len(batch) + 1) > batch_tokens):
                b = collate([split[j] for j in batch])
                n_tok += int(b["attention_mask"].sum())
                batch, longest = [], 0
            if i is not None:
                batch.append(i)
                longest = max(longest, lengths[i])
    return n_tok / (time.perf_counter() - t0), split.num_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="llama", choices=["llama", "deepseek_v3"])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--samples-per-file", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager, fast start)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args()
    setup_logging()

    from eagle3.artifacts import store
    from eagle3.stages.s02_extract.config import ExtractConfig
    from eagle3.artifacts.workdir import WorkDir
    from eagle3.stages.s02_extract.inputs import check_store_identity, split_lengths, validate
    from eagle3.stages.s02_extract.plan import box_files, plan_files
    from eagle3.stages.s02_extract.results import write_results

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        target, workdir = prepare(work, a.kind)
        cfg = ExtractConfig(work_dir=workdir, target_model=str(target), backend="vllm",
                            samples_per_file=a.samples_per_file, batch_tokens=a.batch_tokens,
                            gpu_memory_utilization=0.3, enforce_eager=not a.compile, force=True)
        p = validate(cfg)
        check_store_identity(p, force=True)
        files = box_files(plan_files(p.num_samples, cfg.samples_per_file), 1, 0)
        tokens = sum(int(split_lengths(p.workdir, s).sum()) for s in ("train", "eval"))

        t = compare(cfg, p, files, a.passes)
        t_plain, t_extract = statistics.median(t["plain"]), statistics.median(t["extract"])
        ratios = sorted(e / q for e, q in zip(t["extract"], t["plain"]))
        ratios_engine = sorted(e / q for e, q in zip(t["engine_only"], t["plain"]))
        m = write_results(cfg, p, plan_files(p.num_samples, cfg.samples_per_file))
        disk = sum(f.stat().st_size for f in WorkDir(workdir).store().glob("*.safetensors"))
        read_tps, read_tokens = read_throughput(workdir, a.batch_tokens)

        print(f"\n== stage 02 benchmark: tiny {a.kind} (hidden {p.info.hidden_size}, {p.info.num_layers} layers, "
              f"vocab {p.info.vocab_size}), vLLM CPU build, aux layers {p.aux_layers}, "
              f"{'compiled' if a.compile else 'enforce_eager'}, {a.passes} passes (median)")
        print(f"prompts: {sum(p.num_samples.values())} samples, {tokens} tokens, {len(files)} files of "
              f"<= {cfg.samples_per_file} samples")
        print(f"plain vLLM prefill (max_tokens=1): {tokens / t_plain:10.0f} tokens/s  ({t_plain:.2f} s)")
        print(f"stage 02 extraction (vLLM + store): {tokens / t_extract:10.0f} tokens/s  ({t_extract:.2f} s)")
        print(f"extraction / plain prefill time:    {statistics.median(ratios):10.3f}x  (median of per-pass "
              f"ratios {', '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.15x)")
        print(f"  of which vLLM extraction + connector: {statistics.median(ratios_engine):6.3f}x  (files renamed, not "
              f"finalized; per-pass {', '.join(f'{r:.2f}' for r in ratios_engine)})")
        print(f"bytes per token on disk:            {disk / tokens:10.1f}  (formula 2H(A+1)+9 = "
              f"{m.counts['bytes_per_token']}; reference case H=7168, A=3: "
              f"{store.bytes_per_token(7168, 3)})")
        print(f"store read into training batches:   {read_tps:10.0f} tokens/s  ({read_tokens} train tokens, "
              f"batches of <= {a.batch_tokens} padded tokens, shuffled, 3 epochs)")


if __name__ == "__main__":  # vLLM spawns engine processes that re-import this file
    main()

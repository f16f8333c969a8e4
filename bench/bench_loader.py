"""Stage 04's loader against the step: does training ever wait for the store?

    python bench/bench_loader.py [--hidden 7168] [--tokens 24576] [--batch-tokens 8192] [--passes 2]
    python bench/bench_loader.py ... --demo WORK --target TARGET [--steps 20]

1. Writes two synthetic stores (3 aux layers, random states, samples of 256-4096 tokens) at
   `--hidden` (7168: Kimi-K2.5's width) into a temporary folder, bf16 and fp8, and reads
   each, on a warm page cache (the disk's own speed is not in these figures), in stage 04's
   micro-batches (`--batch-tokens` packed tokens, `load_batch` over an `EpochPlan`):
   loader tokens/s with the states decoded on the CPU (what the training thread does
   without the loader, and the loader thread on a CPU run) and, for fp8, with the states
   left encoded (what the loader thread does on a GPU, which decodes them itself).
2. The step they must keep up with: the H200 step time of configs/kimi-k2.5.yaml's drafter
   at that micro-batch, from its FLOPs (eagle3/stages/s04_train/memory.py `param_count`:
   2 FLOP per matmul weight and token in the forward, twice that in the backward, per TTT
   step, plus causal attention over rows of `max_seq_len`) at the H200's dense bf16 peak
   (989 TFLOP/s) and at a 40% utilisation; the step on this CPU is --demo's.
3. Sync against prefetch in this process: a training thread whose step is a wait of the
   H200 step time (on a GPU the thread waits for the device while it computes) takes
   `--steps` micro-batches loading each itself, then from a `Prefetcher` (depth 2):
   seconds per micro-batch and the time it waited for data.
4. --demo WORK --target TARGET: stage 04 on a copy of WORK's stages 01-03 (the SmolLM2
   demo's, configs/smollm2-135m.yaml's train settings), `--steps` optimizer steps with
   --prefetch 0 and with --prefetch 2, in this process, after one warm-up step each:
   seconds per step.
Prints one table per section (markdown) for docs/results.md.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.artifacts import store  # noqa: E402
from eagle3.drafter.model import DrafterConfig  # noqa: E402
from eagle3.stages.s04_train.data import Batching, EpochPlan, Prefetcher, load_batch  # noqa: E402
from eagle3.stages.s04_train.memory import param_count  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H200_BF16_FLOPS = 989e12  # dense bf16 peak (NVIDIA's H200 data sheet, without sparsity)
UTILISATION = 0.4
# configs/kimi-k2.5.yaml's drafter and train settings (bench/bench_memory.py builds the same shape)
KIMI = dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
            target_hidden_size=7168, draft_vocab_size=32000, target_vocab_size=163840,
            max_position_embeddings=262144)
KIMI_TTT, KIMI_SEQ = 7, 4096
A = 3


def build_store(d: Path, hidden: int, tokens: int, store_dtype: str, seed: int = 0) -> store.HiddenStateStore:
    """A one-split synthetic store of about `tokens` tokens in files of ~8192 tokens."""
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    entries, first, k = [], 0, 0
    while first == 0 or sum(e["num_tokens"] for e in entries) < tokens:
        lengths = []
        while sum(lengths) < 8192:
            lengths.append(int(rng.integers(256, 4097)))
        ids = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
        partial = d / store.partial_name("train", k)
        lay = store.create_partial_file(partial, split="train", file_no=k, first_sample=first, input_ids=ids,
                                        loss_masks=[np.ones(n, np.int8) for n in lengths], hidden_size=hidden,
                                        aux_layers=[2, 30, 58], identity_hash="bench")
        row = 0
        for n in lengths:
            store.write_sample_states(partial, row, torch.randn(n, A, hidden, generator=g) * 4,
                                      torch.randn(n, hidden, generator=g), lay)
            row += n
        entries.append(store.finalize_file(
            partial, d / store.file_name("train", k), split="train", file_no=k, first_sample=first,
            sample_ids=[f"s{first + i}" for i in range(len(lengths))], identity_hash="bench",
            normalize=lambda x: x, argmax=lambda x: torch.zeros(x.shape[0], dtype=torch.int64),
            store_dtype=store_dtype))
        first, k = first + len(lengths), k + 1
    index = {"store_format": store.STORE_FORMAT,
             "identity": {"aux_layers": [2, 30, 58], "hidden_size": hidden, "num_layers": 61, "vocab_size": 1000,
                          "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields(store_dtype)},
             "splits": {"train": {"num_samples": first, "samples_per_file": first, "num_files": k,
                                  "files": entries}}}
    return store.HiddenStateStore(d, index, None, verify="off", needed_by="bench")


def micro_batches(split, batch_tokens: int, max_seq_len: int) -> list[list[int]]:
    plan = EpochPlan(split.lengths(), Batching(batch_tokens, max_seq_len, seed=0), rank=0, world=1, grad_accum=1)
    return [plan.micro_batches(s)[0] for s in range(plan.steps_in(0))]


def loader_rate(split, micro: list[list[int]], max_seq_len: int, decode: bool, passes: int) -> tuple[float, float]:
    """(tokens/s, store MB/s) of load_batch over `micro`, after one untimed pass (warm cache)."""
    def one_pass() -> int:
        n = 0
        for idx in micro:
            n += int(load_batch(split, idx, max_seq_len, packed=True, decode=decode)["attention_mask"].sum())
        return n

    one_pass()
    t0 = time.perf_counter()
    tokens = sum(one_pass() for _ in range(passes))
    dt = time.perf_counter() - t0
    return tokens / dt, tokens * split.store.bytes_per_token / dt / 1e6


def h200_step_seconds(batch_tokens: int, ttt: int = KIMI_TTT, seq: int = KIMI_SEQ) -> tuple[float, float]:
    """(FLOPs, seconds at UTILISATION of the H200's bf16 peak) of one micro-batch of stage 04."""
    c = DrafterConfig(**KIMI)
    _, matmul = param_count(c)
    attn = 2 * 2 * (seq / 2) * c.num_attention_heads * c.head_dim  # QK^T and PV, causal: half the keys
    flops = 3 * ttt * batch_tokens * (2 * matmul + attn)  # forward + backward (twice the forward)
    return flops, flops / (H200_BF16_FLOPS * UTILISATION)


def sync_vs_prefetch(split, micro: list[list[int]], max_seq_len: int, decode: bool, step_s: float,
                     steps: int) -> dict[str, tuple[float, float]]:
    """mode -> (s per micro-batch, s of it waiting for data) with a step of `step_s` seconds."""
    micro = (micro * (steps // len(micro) + 1))[:steps]
    load = lambda idx: load_batch(split, idx, max_seq_len, packed=True, decode=decode)  # noqa: E731
    out = {}
    t0, waited = time.perf_counter(), 0.0
    for idx in micro:
        w = time.perf_counter()
        load(idx)
        waited += time.perf_counter() - w
        time.sleep(step_s)
    out["sync"] = ((time.perf_counter() - t0) / steps, waited / steps)

    class Plan:  # the Prefetcher reads `micro` in order, one micro-batch per step
        def copy(self):
            return self

        def micro_batches(self, s):
            return [micro[s]]

    pf = Prefetcher(load, Plan(), start=0, total=steps, depth=2, pin=False, files=split.file_names)
    try:
        t0, waited = time.perf_counter(), 0.0
        for s in range(steps):
            w = time.perf_counter()
            pf.get(s, 0)
            waited += time.perf_counter() - w
            time.sleep(step_s)
        out["prefetch"] = ((time.perf_counter() - t0) / steps, waited / steps)
    finally:
        pf.close()
    return out


def demo_steps(work: Path, target: str, steps: int) -> dict[int, float]:
    """--prefetch -> seconds per optimizer step of stage 04 on a copy of `work` (demo settings)."""
    from eagle3.artifacts.workdir import WorkDir
    from eagle3.stages.s04_train import run as train_run
    from eagle3.stages.s04_train.config import TrainConfig
    from eagle3.stages.s04_train.distributed import init_distributed

    settings = dict(ttt_steps=3, init_layer=-1, init_head=True, learning_rate=3e-3, warmup_steps=20,
                    batch_tokens=4096, max_seq_len=1024)  # configs/smollm2-135m.yaml's train section
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-loader-demo-") as tmp:
        for prefetch in (0, 2):
            workdir = Path(tmp) / f"p{prefetch}"
            for key in ("prepare", "extract", "vocab"):
                shutil.copytree(WorkDir(work).stage_dir(key), WorkDir(workdir).stage_dir(key))
            cfg = TrainConfig(work_dir=workdir, target_model=target, max_steps=steps + 1, prefetch=prefetch, **settings)
            device = torch.device("cpu")
            src = train_run.read_inputs(cfg, WorkDir(workdir))
            tr = train_run.Trainer(cfg, WorkDir(workdir), src, device, init_distributed(device))
            tr.data.start_prefetch(tr.step, device)
            try:
                tr.drafter.train()
                tr.train_step()  # warm-up: first touches of the mapped files, allocator
                t0 = time.perf_counter()
                for _ in range(steps):
                    tr.train_step()
                out[prefetch] = (time.perf_counter() - t0) / steps
            finally:
                tr.data.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=24576, help="tokens per synthetic store")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per micro-batch (Kimi config: 8192)")
    ap.add_argument("--max-seq-len", type=int, default=KIMI_SEQ)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="micro-batches of section 3, optimizer steps of section 4")
    ap.add_argument("--demo", type=Path, help="a work dir where the SmolLM2 demo ran stages 01-03")
    ap.add_argument("--target", help="with --demo: the target folder its stage 02 read")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    flops, step_s = h200_step_seconds(args.batch_tokens, seq=args.max_seq_len)
    peak_s = flops / H200_BF16_FLOPS
    print(f"\n== H200 step of the Kimi-K2.5 drafter: {args.batch_tokens} tokens per micro-batch, K = {KIMI_TTT}, "
          f"rows of {args.max_seq_len}: {flops / 1e12:.1f} TFLOP -> {peak_s:.3f} s at the bf16 peak, "
          f"{step_s:.3f} s at {UTILISATION:.0%} ({args.batch_tokens / step_s:,.0f} tokens/s per GPU)")
    rows3 = []
    print(f"\n== loader alone, hidden {args.hidden}, {A} aux layers, {torch.get_num_threads()} threads, warm page cache")
    print("| store | states | bytes/token | loader tokens/s | MB/s | x the H200 step's tokens/s (40%) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        for store_dtype in ("bf16", "fp8"):
            d = Path(tmp) / store_dtype
            s = build_store(d, args.hidden, args.tokens, store_dtype)
            split = s.split("train")
            micro = micro_batches(split, args.batch_tokens, args.max_seq_len)
            modes = [("decoded on the CPU", True)] + ([("encoded (decoded on the GPU)", False)]
                                                     if store_dtype == "fp8" else [])
            for label, decode in modes:
                tps, mbs = loader_rate(split, micro, args.max_seq_len, decode, args.passes)
                print(f"| {store_dtype} | {label} | {s.bytes_per_token:,} | {tps:,.0f} | {mbs:,.0f} | "
                      f"{tps * step_s / args.batch_tokens:.2f} |")
                res = sync_vs_prefetch(split, micro, args.max_seq_len, decode, step_s, args.steps)
                rows3.append((store_dtype, label, res))
            shutil.rmtree(d)
    print(f"\n== a training thread whose step waits {step_s:.3f} s (the H200 step) per micro-batch: "
          f"{args.steps} micro-batches")
    print("| store | states | sync s/micro-batch | sync wait for data | prefetch s/micro-batch | prefetch wait |")
    print("|---|---|---|---|---|---|")
    for store_dtype, label, res in rows3:
        (ss, sw), (ps, pw) = res["sync"], res["prefetch"]
        print(f"| {store_dtype} | {label} | {ss:.3f} | {sw:.3f} | {ps:.3f} | {pw:.3f} |")
    if args.demo:
        if not args.target:
            ap.error("--demo needs --target (the target folder stage 02 read)")
        res = demo_steps(args.demo, args.target, args.steps)
        print(f"\n== stage 04 on the demo's store ({args.demo}), {args.steps} steps after a warm-up step")
        print("| --prefetch | s/step |")
        print("|---|---|")
        for k, v in res.items():
            print(f"| {k} | {v:.3f} |")


if __name__ == "__main__":
    main()

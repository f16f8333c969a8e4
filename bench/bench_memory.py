"""Stage 04's memory at the reference size: measured activations, the fitted growth, the
predicted peak per GPU for configs/kimi-k2.5.yaml; and (--cuda) the same check on a GPU.

    python bench/bench_memory.py [--seq 512 1024 2048] [--attention sdpa reference]
    python bench/bench_memory.py --cuda [--steps 3]          # on one GPU (scripts/gpu_check_train.sh)
    python bench/bench_memory.py --cuda --dry-run            # the GPU path at tiny widths, on the CPU

CPU mode: builds the Kimi-K2.5 drafter at its real widths (hidden 7168, 56 heads of
128, 8 kv heads, MLP 18432, draft vocab 32000, target vocab 163840, K = 7) and runs
one `ttt_loss` forward per row length under bf16 autocast with the real CPU kernels,
counting the bytes autograd keeps (saved-tensor hooks, each storage once; the
tensors are dropped as they are saved, so no backward runs and the process needs
only the weights, ~7 GB, plus one step's working set). One row per run, every
position carrying loss. The measurements are fitted as c0 + c1 T + c2 T^2 per row
and compared with eagle3/train/memory.py's formula, which then predicts the peak
per GPU (weights, AdamW, grads, bf16 copies, frozen embedding, batch, activations,
backward transient, DDP buckets) at 2048/4096/8192-token rows for the shipped
config. About 7 minutes on 2 cores (a forward is ~1.6 GFLOP per token and step).

GPU mode: a few stage-04 training steps (forward, backward, clip, AdamW) on synthetic
data at the reference widths, one packed row of the config's batch_tokens in
4096-token samples, bf16 autocast; prints torch.cuda.max_memory_allocated next to
the prediction. It first checks the CUDA attention kernels against the reference
attention at a small shape.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3.train.memory import (GIB, bf16_copy_bytes, measure_training_forward, param_count,  # noqa: E402
                                 predict_peak, saved_bytes_per_token)
from eagle3.ttt import TTTConfig, TTTModel, target_draft_distribution  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KIMI = dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
            target_hidden_size=7168, draft_vocab_size=32000, target_vocab_size=163840,
            max_position_embeddings=262144)
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            target_hidden_size=128, draft_vocab_size=512, target_vocab_size=1024, max_position_embeddings=8192)


def kimi_train_section() -> dict:
    return yaml.safe_load((ROOT / "configs" / "kimi-k2.5.yaml").read_text())["train"]


def fit(ts: list[int], ys: list[float]) -> list[float]:
    """Least squares c0 + c1 T + c2 T^2 (exact through three points)."""
    A = torch.tensor([[1.0, t, t * t] for t in ts], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(A, y).solution[:, 0].tolist()


def cpu_measure(seqs: list[int], attentions: list[str], K: int) -> None:
    c = DrafterConfig(**KIMI)
    P, _ = param_count(c)
    print(f"drafter: hidden {c.hidden_size}, {c.num_attention_heads} heads x {c.head_dim} ({c.num_key_value_heads} kv), "
          f"MLP {c.intermediate_size}, vocab {c.draft_vocab_size}/{c.target_vocab_size}, K={K}; "
          f"{P / 1e6:.0f}M parameters; measured on CPU with the real kernels, bf16 autocast, one row")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(c)
    print(f"{'attention':>9} {'T':>6} {'saved MiB':>10} {'bytes/token':>12} {'formula':>12} {'diff':>6} {'s':>5}")
    for attention in attentions:
        drafter.set_attention(attention)
        ys = []
        for T in seqs:
            t0 = time.perf_counter()
            b = measure_training_forward(drafter, row_len=T, ttt_steps=K)
            dt = time.perf_counter() - t0
            ys.append(b)
            pred = bf16_copy_bytes(c) + T * saved_bytes_per_token(c, K, attention, T)
            print(f"{attention:>9} {T:6d} {b / 2**20:10.0f} {b / T:12,.0f} {pred / T:12,.0f} "
                  f"{100 * (b - pred) / pred:+5.1f}% {dt:5.0f}", flush=True)
        c0, c1, c2 = fit(seqs, ys)
        print(f"{attention:>9} fit per row: {c0 / 2**20:.0f} MiB + {c1:,.0f} B x T + {c2:,.1f} B x T^2 "
              f"(the formula's constant: bf16 weight copies, {bf16_copy_bytes(c) / 2**20:.0f} MiB)")


def kimi_predictions(K: int) -> None:
    tr = kimi_train_section()
    c = DrafterConfig(**KIMI)
    bt, ck = int(tr["batch_tokens"]), bool(tr.get("checkpoint_steps", False))
    print(f"\nconfigs/kimi-k2.5.yaml: batch_tokens {bt} per GPU, grad_accum {tr.get('grad_accum', 1)}, "
          f"checkpoint_steps {ck}, 8 GPUs (DDP buckets counted)")
    print(f"{'row T':>6} {'old (reference, padded rows)':>30} {'new (sdpa, packed)':>20}")
    for T in (2048, 4096, 8192):
        old = predict_peak(c, ttt_steps=K, batch_tokens=max(bt, T), row_len=T, attention="reference",
                           checkpoint_steps=ck, ddp=True)
        new = predict_peak(c, ttt_steps=K, batch_tokens=max(bt, T), row_len=T, checkpoint_steps=ck, ddp=True)
        print(f"{T:6d} {old.total / GIB:26.1f} GiB {new.total / GIB:16.1f} GiB")
    T = int(tr["max_seq_len"])
    new = predict_peak(c, ttt_steps=K, batch_tokens=bt, row_len=T, checkpoint_steps=ck, ddp=True)
    print(f"terms at {T}-token rows: {new.summary()}")
    print(f"kimi-k2.5 {T}-token rows: predicted peak {new.total / GIB:.1f} GiB per GPU")


def gpu_check(steps: int, dry_run: bool) -> None:
    dev = torch.device("cpu" if dry_run else "cuda")
    tr = kimi_train_section()
    K = int(tr.get("ttt_steps", 7))
    shape, row, bt = (TINY, 64, 256) if dry_run else (KIMI, 4096, int(tr["batch_tokens"]))
    # 1. the fused-kernel attention against the reference, at a small shape, on this device
    torch.manual_seed(0)
    small = DrafterConfig(**TINY)
    new, ref = Eagle3Drafter(small).to(dev), Eagle3Drafter(small, attention="reference").to(dev)
    ref.load_state_dict(new.state_dict())
    losses, grads = [], []
    for m in (new, ref):
        g = torch.Generator().manual_seed(1)
        aux = torch.randn(2, 96, 3 * small.hidden_size, generator=g).to(dev)
        ids = torch.randint(small.draft_vocab_size, (2, 96), generator=g).to(dev)
        embed = torch.randn(small.target_vocab_size, small.hidden_size, generator=g).to(dev)
        probs = torch.softmax(torch.randn(2, 96, small.draft_vocab_size, generator=g), -1).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = TTTModel(m, TTTConfig(num_steps=K))(aux, ids, embed, probs, torch.roll(ids, -1, 1),
                                                      torch.ones(2, 96, device=dev))
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in m.parameters()]))
    rel = float((grads[0] - grads[1]).norm() / grads[1].norm())
    print(f"attention check on {dev.type}: loss sdpa {losses[0]:.5f} vs reference {losses[1]:.5f}, "
          f"gradient relative difference {rel:.2e} ({'ok' if rel < 5e-2 else 'MISMATCH'})")
    # 2. training steps at the reference widths
    c = DrafterConfig(**shape)
    drafter = Eagle3Drafter(c).to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95))
    model = TTTModel(drafter, TTTConfig(num_steps=K, checkpoint_steps=bool(tr.get("checkpoint_steps", False))))
    g = torch.Generator().manual_seed(2)
    embed = (torch.randn(c.target_vocab_size, c.hidden_size, generator=g) * 0.02).bfloat16().to(dev)
    lm_rows = (torch.randn(c.draft_vocab_size, c.hidden_size, generator=g) * 0.02).bfloat16().to(dev)
    n = bt // row
    ids = torch.randint(c.draft_vocab_size, (1, n * row), generator=g).to(dev)
    aux = torch.randn(1, n * row, 3 * c.hidden_size, generator=g).bfloat16().to(dev)
    final = torch.randn(1, n * row, c.hidden_size, generator=g).bfloat16().to(dev)
    pos = torch.arange(row, device=dev).repeat(n)[None]
    seg = torch.arange(n, device=dev).repeat_interleave(row)[None]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        probs, amax = target_draft_distribution(torch.arange(c.draft_vocab_size, device=dev), target_hidden=final,
                                                lm_head_weight=lm_rows, target_argmax=torch.roll(ids, -1, 1))
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(aux, ids, embed, probs, amax, torch.ones_like(ids), None, pos, seg)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    pred = predict_peak(c, ttt_steps=K, batch_tokens=n * row, row_len=row,
                        checkpoint_steps=bool(tr.get("checkpoint_steps", False)))
    if dev.type != "cuda":
        print(f"dry run on the CPU at tiny widths: {steps} step(s), loss {out.loss.item():.3f}, predicted "
              f"{pred.total / 2**20:.1f} MiB; the GPU check itself needs --cuda without --dry-run on a GPU")
        return
    peak = torch.cuda.max_memory_allocated(dev)
    print(f"{steps} training steps, {n} x {row}-token samples packed in one row, K={K}, bf16 autocast: "
          f"{steps * n * row / dt:,.0f} tokens/s, loss {out.loss.item():.3f}")
    print(f"peak torch.cuda.max_memory_allocated {peak / GIB:.1f} GiB; predicted {pred.total / GIB:.1f} GiB "
          f"(single process, no DDP buckets): {pred.summary()}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--attention", nargs="+", default=["sdpa", "reference"])
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--predict-only", action="store_true", help="skip the CPU measurement")
    p.add_argument("--cuda", action="store_true", help="run the training-step check on one GPU")
    p.add_argument("--dry-run", action="store_true", help="with --cuda: the same path at tiny widths on the CPU")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    if a.cuda:
        gpu_check(a.steps, a.dry_run)
        return
    if not a.predict_only:
        cpu_measure(a.seq, a.attention, a.ttt_steps)
    kimi_predictions(a.ttt_steps)


if __name__ == "__main__":
    main()

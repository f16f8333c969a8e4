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
and compared with eagle3/stages/s04_train/memory.py's formula, which then predicts the peak
per GPU (weights, AdamW, grads, bf16 copies, frozen embedding, batch, activations,
backward transient, DDP buckets) at 2048/4096/8192-token rows for the shipped
config. About 7 minutes on 2 cores (a forward is ~1.6 GFLOP per token and step).

GPU mode (--cuda, what scripts/gpu_check_train.sh runs) judges, one PASS/FAIL line per
check, exit status 1 if any fails (2 without a CUDA device):

  attention  at a small shape (TINY widths, 2 rows of 96 tokens, the config's K), whole
             rows and packed rows: the loss and every gradient (each weight's, and the
             aux input's) of `sdpa` under bf16 autocast against the reference attention
             run in float64, each within ATTN_RTOL relative (L2) error. Measured on CPU
             at this shape (`attention_grad_errors` below, with the CPU kernels, and
             with the CUDA branch through the kernel emulator of
             tests/unit/test_attention_kernel_contract.py): the correct path's worst gradient
             is 1.0e-2 off (bf16 rounding; the reference attention under bf16 is as
             far), the loss 2e-6; the CUDA branch handing the kernel `out` in
             [B, nh, T, D] memory (the code before this check) puts q_proj/k_proj 1.6e-1 (whole
             rows) and 3.6e-1 (packed rows) off while the loss stays right. ATTN_RTOL =
             3e-2 leaves the correct path a factor 3 and fails that defect by a factor
             5; tests/unit/test_attention_kernel_contract.py checks both sides on CPU.
  training   a few stage-04 steps (forward, backward, clip, AdamW) on synthetic data at
             the reference widths, one packed row of the config's batch_tokens in
             samples of its max_seq_len, bf16 autocast: a finite loss.
  memory     peak torch.cuda.max_memory_allocated of those steps within MEMORY_RTOL
             (10%) of eagle3/stages/s04_train/memory.py's prediction (single process, no
             DDP), and peak torch.cuda.max_memory_reserved (what the GPU must hold: the
             allocated bytes and the allocator's fragmentation) at most RESERVED_LIMIT
             times it, with the allocator set as stage 04 sets it
             (eagle3/stages/s04_train/cuda_alloc.py).

--dry-run runs the attention and training checks on the CPU at tiny widths (the CPU
kernels) and skips the memory check. The --cuda path imports only torch and the
project (no pyyaml, vLLM or datasets: `kimi_train_section`), so it runs on a GPU box
that has just torch, transformers, safetensors, numpy and tqdm.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3.stages.s04_train.memory import (GIB, bf16_copy_bytes, measure_training_forward, param_count,  # noqa: E402
                                 predict_peak, saved_bytes_per_token)
from eagle3.drafter.ttt import TTTConfig, TTTModel, target_draft_distribution  # noqa: E402
from eagle3.stages.s04_train.cuda_alloc import configure_cuda_allocator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KIMI = dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
            target_hidden_size=7168, draft_vocab_size=32000, target_vocab_size=163840,
            max_position_embeddings=262144)
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            target_hidden_size=128, draft_vocab_size=512, target_vocab_size=1024, max_position_embeddings=8192)


def kimi_train_section() -> dict:
    """configs/kimi-k2.5.yaml's train section: read with pyyaml where it is installed, else
    (the GPU box of scripts/gpu_check_train.sh may have only torch and a few companions)
    as the flat `key: value` lines that section consists of. tests/stages/test_gpu_check_train.py
    holds the two readings equal, so a section the flat reading cannot read fails in CI."""
    text = (ROOT / "configs" / "kimi-k2.5.yaml").read_text()
    try:
        import yaml
    except ImportError:
        return flat_section(text, "train")
    return yaml.safe_load(text)["train"]


def flat_section(text: str, name: str) -> dict:
    """The `key: scalar` lines under the top-level `name:` of a YAML text, comments dropped."""
    out, inside = {}, False
    for line in text.splitlines():
        body = line.split("#", 1)[0].rstrip()
        if not body:
            continue
        if not line[0].isspace():
            inside = body == f"{name}:"
        elif inside:
            key, _, value = body.strip().partition(":")
            out[key] = _scalar(value.strip())
    return out


def _scalar(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v.strip("'\"")


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


# -- the GPU check (--cuda): one PASS/FAIL line per check, non-zero exit on a miss ----
# Worst relative error allowed for the loss and for each gradient of `sdpa` under bf16
# autocast against the float64 reference attention, at ATTN_SHAPE (module doc: how it
# was set from the correct path's measured bf16 error, and what defect 1 gives there).
ATTN_RTOL = 3e-2
MEMORY_RTOL = 0.10  # measured peak within 10% of eagle3/stages/s04_train/memory.py's prediction
# Stage 04 warns when the prediction passes 85% of the GPU (run.py, log_memory_prediction):
# reserved memory more than 1/0.85 times the prediction could run a GPU out of memory
# with no warning. The caching allocator holds reserved >= allocated; what lies between
# is fragmentation, which expandable segments keep small (cuda_alloc.py).
RESERVED_LIMIT = 1 / 0.85
ATTN_SHAPE = dict(rows=2, row_len=96)  # with TINY widths and the config's ttt_steps
ATTN_PACKED_SAMPLES = ([40, 31, 25], [57, 39])  # sample lengths per row in the packed layout


def attention_grad_errors(dev: torch.device, packed: bool, K: int) -> dict[str, dict[str, float]]:
    """Relative error of the loss and of every gradient, bf16 autocast against float64.

    The same drafter weights over the same batch on `dev`, three times: the reference
    attention in float64 (the truth), then `sdpa` and `reference` under bf16 autocast.
    -> {"sdpa": {name: err}, "reference": {name: err}}, err = |x - x64| / |x64| for
    "loss", the gradient of the aux input ("aux") and each parameter's gradient.
    `packed`: rows holding several samples (one fused-kernel call per sample), else
    whole rows (one call per batch).
    """
    B, T = ATTN_SHAPE["rows"], ATTN_SHAPE["row_len"]
    c = DrafterConfig(**TINY)
    torch.manual_seed(0)
    weights = Eagle3Drafter(c).state_dict()
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(B, T, 3 * c.hidden_size, generator=g)
    ids = torch.randint(c.draft_vocab_size, (B, T), generator=g)
    embed = torch.randn(c.target_vocab_size, c.hidden_size, generator=g)
    probs = torch.softmax(torch.randn(B, T, c.draft_vocab_size, generator=g), -1)
    pos = seg = None
    if packed:
        seg = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in ATTN_PACKED_SAMPLES])
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ATTN_PACKED_SAMPLES])
        assert seg.shape == (B, T), "ATTN_PACKED_SAMPLES must fill ATTN_SHAPE"

    def run(attention: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        m = Eagle3Drafter(c, attention=attention)
        m.load_state_dict(weights)
        m.to(dev, dtype)
        x = aux.to(dev, dtype, copy=True).requires_grad_()  # a fresh leaf per run: grads must not add up
        on = lambda t: None if t is None else t.to(dev)  # noqa: E731
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype != torch.float64):
            out = TTTModel(m, TTTConfig(num_steps=K))(x, on(ids), embed.to(dev, dtype), probs.to(dev, dtype),
                                                      on(torch.roll(ids, -1, 1)), torch.ones(B, T, device=dev),
                                                      None, on(pos), on(seg))
        out.loss.backward()
        got = {"loss": out.loss.detach(), "aux": x.grad}
        got.update((n, p.grad) for n, p in m.named_parameters())
        return {n: t.double().cpu() for n, t in got.items()}

    truth = run("reference", torch.float64)
    errors = {}
    for attention in ("sdpa", "reference"):
        got = run(attention, torch.float32)
        errors[attention] = {n: float((got[n] - t).norm() / t.norm()) for n, t in truth.items()}
    return errors


def judge_attention(errors: dict[str, dict[str, float]], layout: str, dev: torch.device) -> tuple[bool, str]:
    """(passed, the check's one line) for `attention_grad_errors`' result."""
    sdpa, ref = errors["sdpa"], errors["reference"]
    name = max(sdpa, key=sdpa.get)
    ok = sdpa[name] <= ATTN_RTOL
    return ok, (f"{'PASS' if ok else 'FAIL'} attention on {dev.type}, {layout}: worst of the loss and "
                f"{len(sdpa) - 1} gradients of sdpa vs the float64 reference under bf16 autocast is {name} "
                f"{sdpa[name]:.2e} (tolerance {ATTN_RTOL:.0e}; the reference attention's own bf16 error "
                f"{max(ref.values()):.2e})")


def train_steps(dev: torch.device, steps: int, dry_run: bool, K: int):
    """A few stage-04 steps on synthetic data; -> (tokens, seconds, last loss, config, tokens per row)."""
    tr = kimi_train_section()
    bt = int(tr["batch_tokens"])
    shape, row, bt = (TINY, 64, 256) if dry_run else (KIMI, min(int(tr["max_seq_len"]), bt), bt)
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
        torch.cuda.empty_cache()  # the attention checks' cached blocks are not this run's reserve
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        probs = target_draft_distribution(torch.arange(c.draft_vocab_size, device=dev), target_hidden=final,
                                          lm_head_weight=lm_rows)
        amax = torch.roll(ids, -1, 1).long()  # what stage 02 would store: every position in the draft vocab
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(aux, ids, embed, probs, amax, torch.ones_like(ids), None, pos, seg)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return n * row, time.perf_counter() - t0, float(out.loss.detach()), c, row


def gpu_check(steps: int, dry_run: bool, K: int) -> int:
    """The checks, one PASS/FAIL line each; -> the number of checks that failed."""
    dev = torch.device("cpu" if dry_run else "cuda")
    configure_cuda_allocator(dev)  # as stage 04 does, before the first allocation: the check measures its setting
    failed = 0
    # 1. the fused-kernel attention against the reference, every gradient, at a small shape
    for packed, layout in ((False, "whole rows"), (True, "packed rows")):
        ok, line = judge_attention(attention_grad_errors(dev, packed, K), layout, dev)
        print(line, flush=True)
        failed += not ok
    # 2. training steps at the reference widths (tiny ones in a dry run), peak memory against the prediction
    tokens, dt, loss, c, row = train_steps(dev, steps, dry_run, K)
    tr = kimi_train_section()
    pred = predict_peak(c, ttt_steps=K, batch_tokens=tokens, row_len=row,
                        checkpoint_steps=bool(tr.get("checkpoint_steps", False)))
    ok = loss == loss and abs(loss) != float("inf")
    print(f"{'PASS' if ok else 'FAIL'} training: {steps} step(s) on {dev.type}, {tokens // row} x {row}-token "
          f"samples packed in one row, K={K}, bf16 autocast: loss {loss:.3f}, {steps * tokens / dt:,.0f} tokens/s",
          flush=True)
    failed += not ok
    if dev.type != "cuda":
        print(f"SKIP memory: a dry run measures no GPU memory (predicted {pred.total / 2**20:.1f} MiB at tiny "
              f"widths); the check needs --cuda without --dry-run on a GPU")
        return failed
    judged = judge_memory(torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev), pred,
                          os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    for ok, line in judged:
        print(line, flush=True)
    return failed + sum(not ok for ok, _ in judged)


def judge_memory(allocated: int, reserved: int, pred, alloc_conf: str | None) -> list[tuple[bool, str]]:
    """(passed, line) for the peak allocated bytes (within MEMORY_RTOL of the prediction `pred`)
    and the peak reserved bytes (at most RESERVED_LIMIT times it)."""
    rel = (allocated - pred.total) / pred.total
    ok_a = abs(rel) <= MEMORY_RTOL
    line_a = (f"{'PASS' if ok_a else 'FAIL'} memory allocated: peak torch.cuda.max_memory_allocated "
              f"{allocated / GIB:.2f} GiB vs predicted {pred.total / GIB:.2f} GiB ({100 * rel:+.1f}%, tolerance "
              f"{100 * MEMORY_RTOL:.0f}%; single process, no DDP buckets): {pred.summary()}")
    ratio = reserved / pred.total
    ok_r = ratio <= RESERVED_LIMIT
    line_r = (f"{'PASS' if ok_r else 'FAIL'} memory reserved: peak torch.cuda.max_memory_reserved "
              f"{reserved / GIB:.2f} GiB, {ratio:.3f} x the prediction (limit {RESERVED_LIMIT:.3f}: stage 04 warns at "
              f"85% of the GPU), {(reserved - allocated) / GIB:.2f} GiB above the allocated peak; "
              f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf or '(unset)'}")
    return [(ok_a, line_a), (ok_r, line_r)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--attention", nargs="+", default=["sdpa", "reference"])
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="K (default: configs/kimi-k2.5.yaml's train.ttt_steps, 7)")
    p.add_argument("--predict-only", action="store_true", help="skip the CPU measurement")
    p.add_argument("--cuda", action="store_true",
                   help="run the judged GPU checks (attention, training, memory) on one GPU")
    p.add_argument("--dry-run", action="store_true", help="with --cuda: the same path at tiny widths on the CPU")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    K = a.ttt_steps or int(kimi_train_section().get("ttt_steps", 7))
    if a.cuda:
        if not a.dry_run and not torch.cuda.is_available():
            print(f"FAIL cuda: torch {torch.__version__} sees no CUDA device ("
                  f"{'a CPU build of torch' if torch.version.cuda is None else 'no GPU or driver visible'}); "
                  f"run this on a GPU box with the CUDA build (README 'GPU box install'), or pass --dry-run")
            sys.exit(2)
        failed = gpu_check(a.steps, a.dry_run, K)
        sys.exit(1 if failed else 0)
    if not a.predict_only:
        cpu_measure(a.seq, a.attention, K)
    kimi_predictions(K)


if __name__ == "__main__":
    main()

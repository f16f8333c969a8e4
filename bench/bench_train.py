"""Benchmark stage 04's step on CPU: training tokens/s of the two TTT attentions, padded vs
packed batches, K = 1 and 7; and the padding share of both layouts. With --loss, only the
step time of each named loss against forward KL (the default) in the same process.

    python bench/bench_train.py [--steps 2] [--seq 1024 2048] [--tokens 6000] [--quick]
    python bench/bench_train.py --loss tv lk_alpha lk_lambda kl:0.1,tv:0.9 [--k 3] [--seq 2048] [--rounds 5]

Fixed mid-size drafter: H=512, 8 heads of 64, MLP 2048, draft vocab 8192, target
vocab 32768. Each step is what the trainer does: soft targets from the target's
normed final state and the draft rows of its lm_head, the K-step unroll, backward,
clip, AdamW; tokens/s counts real (non-padding) tokens. Three parts:

1. one full row of T tokens per step (T from --seq): reference vs sdpa attention,
   K = 1 and 7. The first step of each run warms up and is not timed.
2. the same sample set (long-tail lengths, below) trained as right-padded batches
   (eagle3.stages.s04_train.data's length-sorted grouping) and as packed rows, at
   max_seq_len 2048 and batch_tokens 4096, both attentions, K = 1 and 7.
3. padding share (padding positions / computed positions) of an epoch's batches,
   padded vs packed, on the shipped demo chats (tiny tokenizer; tiny-llama.yaml's
   batch_tokens 4096, max_seq_len 512) and on a long-tail length distribution
   (lognormal, median 600 tokens, cropped at 4096; kimi-k2.5.yaml's 8192 / 4096).

--loss (eagle3/drafter/losses.py): one drafter and one packed row of --seq tokens (the last
one given), sdpa, K from --k (3 by default, the demo's), fp32 or with --bf16 under bf16
autocast. Each round times one training step
(labels, unroll, backward, clip, AdamW) of every loss and of kl, in an order that rotates
per round, and the figure is the median over rounds of (loss step time / kl step time) of
that round: shared cores drift over minutes, two neighbouring steps much less. The target
is a step no slower than 1.05x kl's.

Peak memory is the process's maximum resident set size (it only grows).
"""
import argparse
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.core.batching import padding_share  # noqa: E402
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3.stages.s04_train.data import Batching, epoch_batches  # noqa: E402
from eagle3.drafter.losses import LossSpec  # noqa: E402
from eagle3.drafter.ttt import TTTConfig, TTTModel, target_draft_distribution  # noqa: E402

H, HEADS, V_D, V_T = 512, 8, 8192, 32768


def long_tail_lengths(n: int, median: float, crop: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.9 + math.log(median)  # lognormal: a few very long samples
    return [int(min(max(16, round(math.exp(v))), crop)) for v in x.tolist()]


def make_drafter(attention: str) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=H // HEADS,
                        intermediate_size=4 * H, target_hidden_size=H, draft_vocab_size=V_D,
                        target_vocab_size=V_T, max_position_embeddings=8192)
    drafter = Eagle3Drafter(cfg, attention=attention)
    ids = torch.randperm(V_T)[:V_D].sort().values
    t2d = torch.zeros(V_T, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_mapping(ids - torch.arange(V_D), t2d)
    return drafter, ids


def make_batch(lengths: list[int], packed: bool, draft_ids: torch.Tensor, g: torch.Generator) -> dict:
    """Synthetic stage-02 tensors for samples of these lengths, padded or packed."""
    if packed:
        B, T = 1, sum(lengths)
    else:
        B, T = len(lengths), max(lengths)
    b = {
        "aux": torch.randn(B, T, 3 * H, generator=g).bfloat16(),
        "final": torch.randn(B, T, H, generator=g).bfloat16(),
        "input_ids": draft_ids[torch.randint(V_D, (B, T), generator=g)],
        "loss_mask": torch.ones(B, T, dtype=torch.int8),
    }
    b["target_argmax"] = torch.roll(b["input_ids"], -1, 1)  # in the draft vocab: every position trains
    if packed:
        b["attention_mask"] = None
        b["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
        b["segment_ids"] = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    else:
        b["attention_mask"] = (torch.arange(T)[None] < torch.tensor(lengths)[:, None])  # [B, T] right padding
        b["position_ids"] = b["segment_ids"] = None
    return b


def run(attention: str, k: int, batches: list[list[int]], packed: bool, warmup: bool = True,
        loss: LossSpec | None = None) -> float:
    """Training tokens/s over `batches` (lists of sample lengths); the first batch warms up."""
    drafter, draft_ids = make_drafter(attention)
    model = TTTModel(drafter, TTTConfig(num_steps=k, loss=loss or LossSpec()))
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(V_T, H, generator=g) * 0.02
    lm_rows = torch.randn(V_D, H, generator=g) * 0.05
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    todo = ([batches[0]] if warmup else []) + batches
    elapsed, tokens = 0.0, 0
    for i, lengths in enumerate(todo):
        batch = make_batch(lengths, packed, draft_ids, g)
        t0 = time.perf_counter()
        probs = target_draft_distribution(torch.arange(V_D), target_hidden=batch["final"], lm_head_weight=lm_rows)
        amax = batch["target_argmax"].long()
        out = model(batch["aux"], batch["input_ids"], embed, probs, amax, batch["loss_mask"],
                    batch["attention_mask"], batch["position_ids"], batch["segment_ids"])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        if i or not warmup:
            elapsed += time.perf_counter() - t0
            tokens += sum(lengths)
    return tokens / elapsed


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def part1(seqs: list[int], steps: int) -> None:
    print("\n1. one full row per step (no padding): training tokens/s")
    print(f"{'T':>6} {'K':>3} {'reference':>10} {'sdpa':>10} {'sdpa/ref':>9}")
    for T in seqs:
        for k in (1, 7):
            r = run("reference", k, [[T]] * steps, packed=False)
            s = run("sdpa", k, [[T]] * steps, packed=False)
            print(f"{T:6d} {k:3d} {r:10,.0f} {s:10,.0f} {s / r:8.2f}x   (peak RSS so far {peak_mib():,.0f} MiB)",
                  flush=True)


def part2(total_tokens: int) -> None:
    max_len, bt = 2048, 4096
    lengths = long_tail_lengths(400, 600, max_len, seed=1)
    chosen, n = [], 0
    for L in lengths:  # the first samples up to total_tokens: one fixed set for every run
        if n >= total_tokens:
            break
        chosen.append(L)
        n += L
    cfg_pad = Batching(bt, max_len, seed=0, packed=False)
    cfg_pack = Batching(bt, max_len, seed=0, packed=True)
    pad = [[chosen[i] for i in b] for b in epoch_batches(chosen, cfg_pad, 0)]
    pack = [[chosen[i] for i in b] for b in epoch_batches(chosen, cfg_pack, 0)]
    share_pad = padding_share(epoch_batches(chosen, cfg_pad, 0), chosen, packed=False)
    print(f"\n2. {len(chosen)} long-tail samples, {n:,} tokens (max_seq_len {max_len}, batch_tokens {bt}): "
          f"{len(pad)} padded batches ({100 * share_pad:.1f}% padding) vs {len(pack)} packed rows (0% padding); "
          f"training tokens/s (real tokens)")
    print(f"{'attention':>10} {'K':>3} {'padded':>10} {'packed':>10} {'packed/padded':>14}")
    for attention in ("reference", "sdpa"):
        for k in (1, 7):
            a = run(attention, k, pad, packed=False)
            b = run(attention, k, pack, packed=True)
            print(f"{attention:>10} {k:3d} {a:10,.0f} {b:10,.0f} {b / a:13.2f}x", flush=True)


def part3() -> None:
    from eagle3.demo.tiny import build_tokenizer, chat_token_ids

    print("\n3. padding share of one epoch (padding positions / computed positions)")
    demo = [len(s) for s in chat_token_ids(build_tokenizer())]
    tail = long_tail_lengths(20000, 600, 4096, seed=2)
    for name, lengths, bt, msl in (("demo chats (tiny tokenizer)", demo, 4096, 512),
                                   ("long tail (lognormal, median 600)", tail, 8192, 4096)):
        cropped = [min(n, msl) for n in lengths]
        row = [name, f"{len(lengths)} samples, mean {sum(cropped) / len(cropped):.0f} tokens, "
                     f"batch_tokens {bt}, max_seq_len {msl}:"]
        for packed in (False, True):
            batches = epoch_batches(lengths, Batching(bt, msl, seed=0, packed=packed), 0)
            share = padding_share(batches, cropped, packed=packed)
            row.append(f"{'packed' if packed else 'padded'} {100 * share:.1f}% ({len(batches)} batches)")
        print("  " + " ".join(row[:2]) + " " + ", ".join(row[2:]))


def losses(names: list[str], k: int, T: int, rounds: int, bf16: bool = False) -> None:
    """Step time of each loss against kl's, round by round on one drafter and batch (module doc)."""
    specs = {name: LossSpec.parse(name) for name in ["kl"] + [n for n in names if n != "kl"]}
    print(f"\nloss: one packed row of {T} tokens per step, sdpa, K = {k}, {'bf16 autocast' if bf16 else 'fp32'}, "
          f"{rounds} rounds of one step per loss (after one warm-up step each); step time relative to kl's in the "
          f"same round")
    drafter, draft_ids = make_drafter("sdpa")
    models = {name: TTTModel(drafter, TTTConfig(num_steps=k, loss=spec)) for name, spec in specs.items()}
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(V_T, H, generator=g) * 0.02
    lm_rows = torch.randn(V_D, H, generator=g) * 0.05
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    batch = make_batch([T], True, draft_ids, g)

    def step(name: str) -> float:
        t0 = time.perf_counter()
        probs = target_draft_distribution(torch.arange(V_D), target_hidden=batch["final"], lm_head_weight=lm_rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as stage 04's precision auto on AMX CPUs
            out = models[name](batch["aux"], batch["input_ids"], embed, probs, batch["target_argmax"].long(),
                               batch["loss_mask"], batch["attention_mask"], batch["position_ids"], batch["segment_ids"])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        return time.perf_counter() - t0

    order = list(specs)
    for name in order:
        step(name)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in order}
    ratios: dict[str, list[float]] = {name: [] for name in order[1:]}
    for r in range(rounds):
        took = {name: step(name) for name in order[r % len(order):] + order[:r % len(order)]}  # rotated order
        for name in order:
            seconds[name].append(took[name])
        for name in ratios:
            ratios[name].append(took[name] / took["kl"])
    print(f"{'loss':>16} {'step s (median)':>16} {'vs kl (median)':>15}  range over rounds")
    print(f"{'kl':>16} {statistics.median(seconds['kl']):16.3f} {1.0:15.3f}")
    for name, rs in ratios.items():
        ratio = statistics.median(rs)
        print(f"{name:>16} {statistics.median(seconds[name]):16.3f} {ratio:15.3f}  [{min(rs):.3f}, {max(rs):.3f}]  "
              f"{'within' if ratio <= 1.05 else 'OVER'} 1.05x", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="timed steps per run in part 1")
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--tokens", type=int, default=6000, help="sample tokens per run in part 2")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--loss", nargs="+", help="time only these --loss values against kl (e.g. tv lk_lambda "
                                             "kl:0.1,tv:0.9)")
    p.add_argument("--k", type=int, default=3, help="with --loss: the TTT steps")
    p.add_argument("--rounds", type=int, default=9, help="with --loss: rounds of one step of every loss and kl")
    p.add_argument("--bf16", action="store_true", help="with --loss: under bf16 autocast (stage 04's precision on "
                                                      "GPUs and AMX CPUs); fp32 otherwise, as parts 1-2")
    a = p.parse_args()
    if a.quick:
        a.steps, a.seq, a.tokens, a.rounds = 1, [256], 3000, 2
    print(f"drafter H={H}, {HEADS} heads, draft vocab {V_D}, target vocab {V_T}, {torch.get_num_threads()} threads")
    if a.loss:
        losses(a.loss, a.k, a.seq[-1], a.rounds, a.bf16)
        return
    part3()
    part1(a.seq, a.steps)
    part2(a.tokens)


if __name__ == "__main__":
    main()

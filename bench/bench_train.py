"""Benchmark stage 04's step: training tokens/s and peak memory on CPU.

    python bench/bench_train.py [--steps 3] [--seq 1024] [--ttt-steps 7]

Fixed mid-size config: drafter H=512, 8 heads, draft vocab 8192, target vocab
32768, one 1024-token sequence per step, K=7 train-time-test steps. Each step is
what the trainer does: soft targets from the target's normed final state and the
draft rows of its lm_head, the K-step unroll, backward, clip, AdamW. The same run
is repeated with K=1 in this process, and the ratio says what the unroll costs.
Peak memory is the process's maximum resident set size, read after each run.
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3.ttt import TTTConfig, TTTModel, target_draft_distribution  # noqa: E402

H, HEADS, V_D, V_T = 512, 8, 8192, 32768


def run(seq: int, k: int, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=H // HEADS,
                        intermediate_size=4 * H, target_hidden_size=H, draft_vocab_size=V_D,
                        target_vocab_size=V_T, max_position_embeddings=4096)
    drafter = Eagle3Drafter(cfg)
    ids = torch.randperm(V_T)[:V_D].sort().values
    t2d = torch.zeros(V_T, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_mapping(ids - torch.arange(V_D), t2d)
    model = TTTModel(drafter, TTTConfig(num_steps=k))
    embed = torch.randn(V_T, H) * 0.02
    lm_rows = torch.randn(V_D, H) * 0.05
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    batch = {
        "aux": torch.randn(1, seq, 3 * H).bfloat16(),
        "final": torch.randn(1, seq, H).bfloat16(),
        "input_ids": ids[torch.randint(V_D, (1, seq))],
        "loss_mask": torch.ones(1, seq, dtype=torch.int8),
    }
    batch["target_argmax"] = torch.roll(batch["input_ids"], -1, 1)  # in the draft vocab: every position trains
    times = []
    for step in range(steps + 1):  # the first step warms up allocators and is not timed
        t0 = time.perf_counter()
        probs, amax = target_draft_distribution(torch.arange(V_D), target_hidden=batch["final"],
                                                lm_head_weight=lm_rows, target_argmax=batch["target_argmax"])
        out = model(batch["aux"], batch["input_ids"], embed, probs, amax, batch["loss_mask"])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return seq * len(times) / sum(times), peak_mib


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=7)
    a = p.parse_args()
    print(f"drafter H={H}, {HEADS} heads, draft vocab {V_D}, target vocab {V_T}, seq {a.seq}, "
          f"{torch.get_num_threads()} threads")
    tps_k, peak_k = run(a.seq, a.ttt_steps, a.steps)
    print(f"K={a.ttt_steps}: {tps_k:,.0f} training tokens/s, peak RSS {peak_k:,.0f} MiB")
    tps_1, _ = run(a.seq, 1, a.steps)
    print(f"K=1: {tps_1:,.0f} training tokens/s")
    print(f"unroll cost: K={a.ttt_steps} step takes {tps_1 / tps_k:.2f}x the time of a K=1 step")


if __name__ == "__main__":
    main()

"""eagle3/stages/s04_train/memory.py: the per-token activation formula against a measurement.

The formula is what stage 04 prints and bench/bench_memory.py scales to the
reference widths; here it is checked at small, all-different widths on the CPU
with the real kernels under bf16 autocast. If the model changes what autograd
keeps, this test says by how much. About 6 s on 2 cores.
"""
from __future__ import annotations

import pytest
import torch

from eagle3.drafter.cpu import bf16_fused_attention_ok
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.stages.s04_train.memory import (bf16_copy_bytes, measure_saved_bytes, measure_training_forward, param_count,
                                            predict_peak, saved_bytes_per_token)

CFG = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=160,
           target_hidden_size=96, draft_vocab_size=300, target_vocab_size=700, max_position_embeddings=4096)


@pytest.mark.parametrize("attention,ckpt", [("sdpa", False), ("reference", False), ("sdpa", True)])
def test_formula_matches_measured_saved_bytes(attention, ckpt):
    c = DrafterConfig(**CFG)
    torch.manual_seed(0)
    m = Eagle3Drafter(c, attention=attention)
    K, T = 3, 256
    measured = measure_training_forward(m, row_len=T, ttt_steps=K, checkpoint_steps=ckpt)
    copies = 0 if ckpt else bf16_copy_bytes(c)  # checkpointed steps keep no weight copy either
    # Where the fused CPU kernel refuses bf16 (other CPUs, ATEN_CPU_CAPABILITY=default) the
    # attention runs in float32 and keeps more; the formula says how much.
    predicted = copies + T * saved_bytes_per_token(c, K, attention, T, ckpt,
                                                   fp32_attention=not bf16_fused_attention_ok())
    assert measured == pytest.approx(predicted, rel=0.02), (measured, predicted)


def test_each_storage_counts_once_and_parameters_not_at_all():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(10, 64)

    def fwd():
        y = x @ w  # saves x and w
        (y * y).sum()  # saves y twice (one storage)

    assert measure_saved_bytes(fwd, exclude=[w]) == x.nbytes + 10 * 64 * 4


def test_param_count_is_the_modules_own():
    c = DrafterConfig(**CFG)
    m = Eagle3Drafter(c)
    total, matmul = param_count(c)
    assert total == sum(p.numel() for p in m.parameters())
    assert matmul == sum(p.numel() for n, p in m.named_parameters() if not n.endswith("norm.weight"))


def test_peak_terms_at_the_reference_shape():
    """Kimi-K2.5's drafter (hidden 7168, 56 x 128 heads, 8 kv heads, MLP 18432, vocab 32000/163840)."""
    c = DrafterConfig(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128,
                      intermediate_size=18432, target_hidden_size=7168, draft_vocab_size=32000,
                      target_vocab_size=163840, max_position_embeddings=262144)
    P, _ = param_count(c)
    p = predict_peak(c, ttt_steps=7, batch_tokens=8192, row_len=4096)
    assert p.weights == 4 * P and p.adamw == 8 * P and p.embedding == 2 * (163840 + 32000) * 7168
    old = predict_peak(c, ttt_steps=7, batch_tokens=8192, row_len=4096, attention="reference")
    # the reference attention's blocks: (6 nh + 1) bytes x T per token per step
    assert old.activations - p.activations == pytest.approx(8192 * 7 * (6 * 56 + 1) * 4096)
    ck = predict_peak(c, ttt_steps=7, batch_tokens=8192, row_len=4096, checkpoint_steps=True)
    assert ck.activations < p.activations / 10

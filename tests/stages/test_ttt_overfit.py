"""Training learns: a drafter trained by `ttt_loss` on one fixed batch fits it, step 0 first
and the fed-back steps after it (eagle3/drafter/ttt.py; up to 300 optimizer steps, several
seconds, so in this tier; the loss itself is tested in tests/unit/test_ttt.py)."""
from __future__ import annotations

import math

import torch
from fixtures import draft_labels

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt import TTTConfig, ttt_loss


def test_overfits_one_batch():
    torch.manual_seed(0)
    Hs, VD, VT, B, T, K = 64, 64, 96, 4, 32, 3
    cfg = DrafterConfig(hidden_size=Hs, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                        intermediate_size=128, target_hidden_size=Hs, draft_vocab_size=VD,
                        target_vocab_size=VT, max_position_embeddings=T + K)
    m = Eagle3Drafter(cfg)
    embed = torch.randn(VT, Hs)
    aux = torch.randn(B, T, 3 * Hs)
    input_ids = torch.randint(0, VT, (B, T))
    target_logits = 4 * torch.randn(B, T, VT)
    target_logits[..., :VD] += 2  # most argmaxes in the (identity) draft vocab, some not
    probs, argmax = draft_labels(m.draft_ids(), target_logits)
    mask = torch.ones(B, T)
    tcfg = TTTConfig(num_steps=K)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = None
    for i in range(300):
        out = ttt_loss(m, aux, input_ids, embed, probs, argmax, mask, tcfg)
        first = first if first is not None else out.metrics
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        # Stop early (the machine may be shared) once step 0 and the fed-back steps have learned.
        if out.metrics["full_acc_0"] > 0.95 and out.metrics["full_acc_2"] > 0.7:
            break
    mt = out.metrics
    assert mt["num_valid"] > 60
    assert first["full_acc_0"] < 0.2 and mt["full_acc_0"] > 0.9, (first, mt)
    assert mt["loss_0"] < 0.6 * first["loss_0"]  # soft labels: the floor is the targets' entropy
    assert mt["full_acc_0"] >= mt["full_acc_1"] >= mt["full_acc_2"] > 0.6
    assert math.isfinite(mt["expected_accept_length"]) and mt["expected_accept_length"] > 2.0

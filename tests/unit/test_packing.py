"""Packed rows: several samples per row must train each sample exactly as alone.

Covers eagle3/core/batching.py (greedy packing, padding share), eagle3/stages/s04_train/data.py
(packed epochs and rows) and the packed path of eagle3/drafter/ttt.py / eagle3/drafter/model.py,
under both attention implementations, plus per-step activation checkpointing.
About 4 s on 2 cores.
"""
from __future__ import annotations

import pytest
import torch
from fixtures import draft_labels

from eagle3.core.batching import group_by_padded_tokens, pack_greedy, padding_share
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt import TTTConfig, ttt_loss
from eagle3.stages.s04_train.data import Batching, collate_packed, epoch_batches

V_T, V_D, H = 40, 16, 32
LENS = (9, 6, 11)


def drafter(attention: str, seed: int = 0) -> Eagle3Drafter:
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, target_hidden_size=H, draft_vocab_size=V_D,
                        target_vocab_size=V_T, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Eagle3Drafter(cfg, attention=attention).double()


def samples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENS:
        logits = 3 * torch.randn(n, V_T, generator=g, dtype=torch.double)
        logits[:, :V_D] += 2.0
        out.append(dict(input_ids=torch.randint(0, V_T, (n,), generator=g),
                        aux=torch.randn(n, 3 * H, generator=g, dtype=torch.double),
                        logits=logits, loss_mask=(torch.rand(n, generator=g) > 0.2).long()))
    return out


def loss_and_grads(m: Eagle3Drafter, embed, s: dict, K: int, checkpoint: bool = False, **kw):
    probs, argmax = draft_labels(m.draft_ids(), s["logits"][None])
    m.zero_grad()
    out = ttt_loss(m, s["aux"][None], s["input_ids"][None], embed, probs, argmax, s["loss_mask"][None],
                   TTTConfig(num_steps=K, checkpoint_steps=checkpoint), **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_packed_row_gives_each_sample_its_own_loss_and_gradients(attention):
    m = drafter(attention)
    embed = torch.randn(V_T, H, generator=torch.Generator().manual_seed(1), dtype=torch.double)
    ss, K = samples(2), 4
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(LENS)])[None]
    for i in range(len(LENS)):
        # The packed row, with loss only on sample i: equal to sample i alone.
        packed = {k: torch.cat([s[k] if (k != "loss_mask" or j == i) else torch.zeros_like(s[k])
                                for j, s in enumerate(ss)]) for k in ss[0]}
        a, ga = loss_and_grads(m, embed, packed, K, position_ids=pos, segment_ids=seg)
        b, gb = loss_and_grads(m, embed, ss[i], K)
        assert b.metrics["num_valid"] > 0 and a.metrics["num_valid"] == b.metrics["num_valid"]
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-9, atol=1e-12)
        for k in range(K):
            assert a.metrics[f"full_acc_{k}"] == b.metrics[f"full_acc_{k}"]
        for name in gb:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-9, atol=1e-12)
    # Without segment ids (plain causal over the row) the samples leak into each other.
    a, _ = loss_and_grads(m, embed, {k: torch.cat([s[k] for s in ss]) for k in ss[0]}, K, position_ids=pos)
    c, _ = loss_and_grads(m, embed, {k: torch.cat([s[k] for s in ss]) for k in ss[0]}, K,
                          position_ids=pos, segment_ids=seg)
    assert abs(a.loss.item() - c.loss.item()) > 1e-6


def test_checkpointed_steps_give_the_same_loss_and_gradients():
    m = drafter("sdpa", seed=3)
    embed = torch.randn(V_T, H, generator=torch.Generator().manual_seed(4), dtype=torch.double)
    s = samples(5)[2]
    a, ga = loss_and_grads(m, embed, s, 5)
    b, gb = loss_and_grads(m, embed, s, 5, checkpoint=True)
    # The same computation replayed: bitwise on one machine.
    assert a.loss.item() == b.loss.item() and a.metrics == b.metrics
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_pack_greedy_fills_rows_in_order_without_padding():
    lengths = [5, 3, 7, 2, 9, 1]
    assert pack_greedy(range(6), lengths, 10) == [[0, 1], [2, 3], [4, 5]]
    assert pack_greedy([4, 0], lengths, 8) == [[4], [0]]  # a sample longer than the row gets its own
    padded = group_by_padded_tokens(range(6), lengths, 10)
    assert padding_share(pack_greedy(range(6), lengths, 10), lengths, packed=True) == 0.0
    # padded: [5,3] -> 10 computed, [7,2] -> 14, [9] -> 9, [1] -> 1 ... exact share from the batches
    computed = sum(len(b) * max(lengths[i] for i in b) for b in padded)
    assert padding_share(padded, lengths, packed=False) == pytest.approx(1 - sum(lengths) / computed)


def test_packed_epochs_cover_every_sample_once_within_the_budget():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (200,), generator=g).tolist()
    cfg = Batching(batch_tokens=1024, max_seq_len=256, seed=3, packed=True)
    for epoch in (0, 1, None):
        batches = epoch_batches(lengths, cfg, epoch)
        assert sorted(i for b in batches for i in b) == list(range(200))
        assert all(sum(min(lengths[i], 256) for i in b) <= 1024 for b in batches)
    assert epoch_batches(lengths, cfg, 0) == epoch_batches(lengths, cfg, 0)  # a function of (seed, epoch)
    assert epoch_batches(lengths, cfg, 0) != epoch_batches(lengths, cfg, 1)


class _S:
    def __init__(self, n: int, base: int):
        self.input_ids = torch.arange(base, base + n, dtype=torch.int32)
        self.loss_mask = torch.ones(n, dtype=torch.int8)
        self.aux = torch.full((n, 6), float(base)).bfloat16()
        self.final = torch.full((n, 2), float(base)).bfloat16()
        self.target_argmax = torch.arange(base, base + n, dtype=torch.int32)
        self.scale_log2 = None  # decoded states, as the store reader hands them to the loader

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def test_collate_packed_restarts_positions_and_crops():
    b = collate_packed([_S(3, 10), _S(5, 20)], max_seq_len=4)
    assert b["input_ids"].tolist() == [[10, 11, 12, 20, 21, 22, 23]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert b["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    assert b["attention_mask"].all() and b["aux"].shape == (1, 7, 6) and b["aux"].dtype == torch.bfloat16
    assert b["target_argmax"].dtype == torch.int64 and b["loss_mask"].dtype == torch.int8


def kimi_info(**text):
    from eagle3.target.info import TargetInfo

    t = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512,
             intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=50000.0, **text)
    return TargetInfo(source="x", architecture="DeepseekV3ForCausalLM", model_type="kimi_k25", num_layers=61,
                      hidden_size=7168, vocab_size=163840, max_position_embeddings=262144,
                      num_attention_heads=64, text_config_key="text_config", text_config=t)


def test_mla_targets_default_to_head_dim_128_unless_the_user_sets_the_shape():
    from eagle3.drafter.shape import drafter_config_for_target
    from eagle3.stages.s04_train.config import TrainConfig

    base = dict(work_dir="w", target_model="x")
    d = drafter_config_for_target(kimi_info(), TrainConfig(**base), 32000)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (56, 8, 128)
    d = drafter_config_for_target(kimi_info(), TrainConfig(**base, num_attention_heads=64), 32000)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (64, 64, 112)  # the user's choice

"""The linear-memory TTT attention ("sdpa") against the reference one: forward and gradients.

Both implementations run the same drafter weights over the same inputs; the
reference materialises each step's [T, T + k] score block, the default streams
step 0's keys through the fused CPU kernel and merges steps 1..k by log-sum-exp.
Two different computations: compared with a tolerance (float64: 1e-9 relative).
About 5 s on 2 cores.
"""
from __future__ import annotations

import pytest
import torch
from attention_helpers import TOL64, H, assert_same, batch, loss_and_grads, pair

from eagle3.drafter.model import Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache, attention_runs


@pytest.mark.parametrize("nkv,K", [(4, 1), (4, 7), (2, 3), (1, 7)])
def test_sdpa_equals_reference_loss_and_gradients(nkv, K):
    """MHA (4 kv heads), GQA (2) and MQA (1); K = 1 (no merge), 3 and 7."""
    new, ref = pair(nkv, seed=nkv + K)
    b = batch(K, B=2, T=13)
    assert_same(loss_and_grads(new, b, K), loss_and_grads(ref, b, K), TOL64)


@pytest.mark.parametrize("left", [False, True])
def test_sdpa_equals_reference_with_padding(left):
    new, ref = pair(2, seed=5)
    input_ids, aux, embed, logits, loss_mask = batch(6, B=3, T=12)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    pos = None
    if left:
        mask = mask.flip(1)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
    kw = dict(attention_mask=mask, position_ids=pos)
    a, b = loss_and_grads(new, (input_ids, aux, embed, logits, loss_mask), 7, **kw), \
        loss_and_grads(ref, (input_ids, aux, embed, logits, loss_mask), 7, **kw)
    assert_same(a, b, TOL64)
    assert all(torch.isfinite(g).all() for g in a[1].values())


def test_sdpa_outputs_equal_reference_at_every_real_position():
    """The step outputs themselves (not only the loss), each step, packed row with a padded tail."""
    new, ref = pair(2, seed=7)
    T = 15
    seg = torch.tensor([[0] * 6 + [1] * 4 + [2] * 3 + [3] * 2])
    mask = torch.ones(1, T, dtype=torch.long)
    mask[0, 13:] = 0  # the last "sample" is padding
    pos = torch.cat([torch.arange(n) for n in (6, 4, 3, 2)])[None]
    g = torch.Generator().manual_seed(8)
    aux = torch.randn(1, T, 3 * H, generator=g, dtype=torch.double)
    embs = [torch.randn(1, T, H, generator=g, dtype=torch.double) for _ in range(7)]
    outs = []
    for m in (new, ref):
        cache, h, steps = TTTCache(), m.project_aux(aux), []
        for e in embs:
            h = m.step(e, h, cache, attention_mask=mask, position_ids=pos, segment_ids=seg)
            steps.append(h)
        outs.append(steps)
    for a, b in zip(*outs):
        torch.testing.assert_close(a[:, :13], b[:, :13], **TOL64)


def test_sdpa_under_bf16_autocast_is_close_to_reference():
    """bf16 autocast (what GPUs train with): both round differently, so a loose tolerance."""
    new, ref = pair(2, seed=9, dtype=torch.float32)
    b = batch(10, B=2, T=24, dtype=torch.float32)
    res = []
    for m in (new, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res.append(loss_and_grads(m, b, 4))
    (oa, ga), (ob, gb) = res
    torch.testing.assert_close(oa.loss, ob.loss, rtol=2e-2, atol=0)
    for name in ga:
        rel = (ga[name] - gb[name]).norm() / gb[name].norm()
        assert rel < 5e-2, (name, float(rel))


def test_runs_of_padded_packed_and_plain_rows():
    assert attention_runs(None, None, 5) is None
    assert attention_runs(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), None, 4) is None  # right padding: whole rows
    assert attention_runs(torch.tensor([[0, 0, 1, 1]]), None, 4) == [(0, 0, 2), (0, 2, 4)]  # left padding: its own run
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    # the padded tail joins the sample before it; the second row is one sample
    assert attention_runs(mask, seg, 7) == [(0, 0, 3), (0, 3, 7), (1, 0, 7)]


def saved_bytes(m: Eagle3Drafter, T: int, K: int) -> int:
    """Bytes autograd keeps for one K-step unroll over one row of T tokens (distinct storages)."""
    seen: dict[int, int] = {}
    params = {p.data_ptr() for p in m.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * H, generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cache, h = TTTCache(), m.project_aux(aux)
        for _ in range(K):
            h = m.step(torch.randn(1, T, H, generator=g), h, cache)
    return sum(seen.values())


def test_saved_state_grows_linearly_with_sdpa_and_quadratically_with_the_reference():
    new, ref = pair(2, seed=11, dtype=torch.float32)
    K = 7
    new_1, new_4 = saved_bytes(new, 256, K), saved_bytes(new, 1024, K)
    ref_1, ref_4 = saved_bytes(ref, 256, K), saved_bytes(ref, 1024, K)
    assert new_4 / new_1 == pytest.approx(4.0, rel=0.02)  # 4x the tokens, 4x the bytes
    assert ref_4 / ref_1 > 10  # the score blocks dominate: close to 16x
    assert ref_4 > 5 * new_4  # 8.7x here at 4 heads of 8; the gap grows with T and heads


def test_unknown_attention_is_refused_and_switching_keeps_the_weights():
    from eagle3.core.errors import PipelineError

    new, _ = pair(2)
    with pytest.raises(PipelineError, match="attention"):
        new.set_attention("flash")
    before = {k: v.clone() for k, v in new.state_dict().items()}
    new.set_attention("reference")
    assert new.midlayer.self_attn.impl == "reference"
    assert all(torch.equal(before[k], v) for k, v in new.state_dict().items())

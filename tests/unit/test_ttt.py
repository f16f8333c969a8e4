"""Tests for eagle3/drafter/ttt.py: label alignment, loss, metrics (that training learns:
tests/stages/test_ttt_overfit.py)."""
from __future__ import annotations

import pytest
import torch
from fixtures import draft_labels

import eagle3.drafter.losses as losses_module
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.drafter.losses import soft_cross_entropy
from eagle3.drafter.ttt import TTTConfig, TTTModel, target_draft_distribution, ttt_loss

V_T, V_D, H = 50, 20, 32


def tiny_drafter(seed: int = 0, draft_ids: list[int] | None = None) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, target_hidden_size=H, draft_vocab_size=V_D,
                        target_vocab_size=V_T, max_position_embeddings=64)
    m = Eagle3Drafter(cfg).double()
    if draft_ids is not None:
        ids = torch.tensor(draft_ids)
        t2d = torch.zeros(V_T, dtype=torch.bool)
        t2d[ids] = True
        m.set_vocab_mapping(ids - torch.arange(V_D), t2d)
    return m


def test_ttt_config_validation():
    assert TTTConfig().num_steps == 7 and TTTConfig().step_weights()[2] == pytest.approx(0.64)
    with pytest.raises(PipelineError, match="num_steps"):
        TTTConfig(num_steps=0)
    with pytest.raises(PipelineError, match="step_decay"):
        TTTConfig(step_decay=1.5)


def test_draft_distribution_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=g)
    w = torch.randn(101, 16, generator=g)
    full = hidden @ w.T  # [2, 37, 101]
    draft_ids = torch.tensor(sorted(torch.randperm(101, generator=g)[:30].tolist()))
    want = torch.softmax(full[..., draft_ids], -1)
    # chunks of 5 positions (the last one short) and one chunk: other matmul shapes, equal up to rounding
    for chunk in (5, 256):
        probs = target_draft_distribution(draft_ids, target_hidden=hidden, lm_head_weight=w, chunk_size=chunk)
        torch.testing.assert_close(probs, want)
    # stage 04's call: the draft rows themselves, indexed by arange(V_d)
    probs = target_draft_distribution(torch.arange(30), target_hidden=hidden, lm_head_weight=w[draft_ids])
    torch.testing.assert_close(probs, want)
    probs, arg = draft_labels(draft_ids, full)
    torch.testing.assert_close(probs, want)
    assert torch.equal(arg, full.argmax(-1))


def make_batch(seed: int, B: int = 2, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    draft_ids = sorted(torch.randperm(V_T, generator=g)[:V_D].tolist())
    input_ids = torch.randint(0, V_T, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g, dtype=torch.double)
    embed = torch.randn(V_T, H, generator=g, dtype=torch.double)
    logits = 3 * torch.randn(B, T, V_T, generator=g, dtype=torch.double)
    logits[..., draft_ids] += 1.0  # about half the argmaxes land in the draft vocab
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).long()
    return draft_ids, input_ids, aux, embed, logits, loss_mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_soft_cross_entropy_is_the_composed_form_and_its_gradient(dtype, monkeypatch):
    """The blocked loss equals -(p * log_softmax(z)).sum() over the gathered target rows and
    has its gradient, also for rows whose mass is not exactly 1 (rounded softmax rows), an
    all-zero row, and row counts that are not a multiple of the block."""
    monkeypatch.setattr(losses_module, "BLOCK_ROWS", 3)
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(7, 11, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    table = torch.softmax(torch.randn(9, 11, generator=g, dtype=torch.float64), dim=-1)
    table[2] *= 1.001
    table[5] = 0.0
    rows = torch.tensor([8, 2, 5, 0, 2, 7, 1])
    fused, argmax = soft_cross_entropy(z, table, rows)
    assert torch.equal(argmax, z.detach().argmax(dim=-1))
    (dz_fused,) = torch.autograd.grad(2.5 * fused, z)
    composed = -(table[rows] * torch.log_softmax(z.double(), dim=-1)).sum()  # the upcast form, in fp64
    (dz_composed,) = torch.autograd.grad(2.5 * composed, z)
    assert fused.shape == () and dz_fused.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(fused.double(), composed, rtol=tol, atol=tol)
    # bf16: the fp32 gradient rounded once to bf16, as the upcast's backward rounds it
    torch.testing.assert_close(dz_fused.double(), dz_composed.to(dtype).double(), rtol=tol, atol=tol)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, table, rows)[0], (z,))


def test_loss_and_metrics_match_explicit_loops():
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(1)
    m = tiny_drafter(2, draft_ids)
    B, T = input_ids.shape
    K, decay = 3, 0.7
    probs, argmax = draft_labels(m.draft_ids(), logits)
    out = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, TTTConfig(num_steps=K, step_decay=decay))

    # Independent: teacher-forced embeddings by hand, labels from the raw target logits.
    with torch.no_grad():
        cache, h, step_logits = TTTCache(), m.project_aux(aux), []
        for k in range(K):
            emb = torch.zeros(B, T, H, dtype=torch.double)
            for b in range(B):
                for t in range(T):
                    if t + 1 + k < T:
                        emb[b, t] = embed[input_ids[b, t + 1 + k]]
            h = m.step(emb, h, cache)
            step_logits.append(m.compute_logits(h))
    total, losses, chain, chains, n_valid0 = 0.0, [], {}, [], 0
    for k in range(K):
        ces, match = [], {}
        for b in range(B):
            for t in range(T):
                p = t + 1 + k  # target row that predicts token t + 2 + k
                if not (t + 2 + k < T and loss_mask[b, t + 2 + k]):
                    continue
                tgt = int(logits[b, p].argmax())
                if tgt not in draft_ids:
                    continue
                q = torch.softmax(logits[b, p, draft_ids], -1)
                lp = torch.log_softmax(step_logits[k][b, t], -1)
                ces.append(float(-(q * lp).sum()))
                match[(b, t)] = draft_ids[int(step_logits[k][b, t].argmax())] == tgt
        if k == 0:
            n_valid0 = len(ces)
            chain = {bt for bt, ok in match.items() if ok}
        else:
            chain = {bt for bt in chain if match.get(bt, False)}
        chains.append(len(chain))
        losses.append(sum(ces) / len(ces))
        total += decay ** k * losses[-1]

    assert n_valid0 > 5  # the example exercises real positions
    assert out.loss.item() == pytest.approx(total, rel=1e-9)
    assert out.metrics["num_valid"] == n_valid0
    for k in range(K):
        assert out.metrics[f"loss_{k}"] == pytest.approx(losses[k], rel=1e-9)
        assert out.metrics[f"full_acc_{k}"] == pytest.approx(chains[k] / n_valid0)
    assert out.metrics["expected_accept_length"] == pytest.approx(1 + sum(c / n_valid0 for c in chains))


def test_out_of_draft_vocab_and_unmasked_positions_carry_no_loss():
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(3)
    m = tiny_drafter(4, draft_ids)
    cfg = TTTConfig(num_steps=2)
    probs, argmax = draft_labels(m.draft_ids(), logits)
    base = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg)
    # Rewriting the labels of rows whose argmax is outside the draft vocab changes nothing.
    outside = ~m.t2d[argmax]
    assert outside.any()
    probs2 = probs.clone()
    probs2[outside] = torch.softmax(torch.randn(int(outside.sum()), V_D, dtype=torch.double), -1)
    assert ttt_loss(m, aux, input_ids, embed, probs2, argmax, loss_mask, cfg).loss.item() == base.loss.item()
    # All argmaxes outside the draft vocab, or an all-zero mask: zero loss, zero count, grads still flow.
    out_ids = [i for i in range(V_T) if i not in draft_ids]
    for am, lm in ((torch.full_like(argmax, out_ids[0]), loss_mask), (argmax, torch.zeros_like(loss_mask))):
        out = ttt_loss(m, aux, input_ids, embed, probs, am, lm, cfg)
        assert out.loss.item() == 0.0 and out.metrics["num_valid"] == 0
        assert out.metrics["expected_accept_length"] == 1.0
        out.loss.backward()


def test_metric_definitions_on_a_hand_made_case():
    """T = 8, K = 3, identity mapping; target argmax of row p is p, except row 6 (id 40, not draftable).

    valid_0 = {0..4}, valid_1 = {0..3}, valid_2 = {0, 1, 2} (t + 2 + k < 8, row t+1+k != 6).
    Hits: step 0 at {0,1,2,3}; step 1 at {0,1,3}; step 2 at {0,2}.
    chain_0 = {0,1,2,3}, chain_1 = {0,1,3}, chain_2 = {0} (t=3 has no step-2 label: a miss;
    t=2 hits at step 2 but missed step 1).
    """
    m = tiny_drafter(0)
    T, K = 8, 3
    argmax = torch.arange(T)[None].clone()
    argmax[0, 6] = 40
    probs = torch.softmax(torch.randn(1, T, V_D, dtype=torch.double), -1)
    hits = {0: {0, 1, 2, 3}, 1: {0, 1, 3}, 2: {0, 2}}
    valid = {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3], 2: [0, 1, 2]}
    step = {"k": 0}

    def fake_logits(hidden):
        k = step["k"]
        step["k"] += 1
        assert hidden.shape[0] == len(valid[k])  # only valid rows reach the lm_head
        rows = []
        for t in valid[k]:
            right = t + 1 + k
            rows.append(torch.nn.functional.one_hot(torch.tensor(right if t in hits[k] else (right + 1) % V_D), V_D))
        return 10.0 * torch.stack(rows).double() + 0 * hidden.sum()

    m.compute_logits = fake_logits
    out = ttt_loss(m, torch.zeros(1, T, 3 * H, dtype=torch.double), torch.zeros(1, T, dtype=torch.long),
                   torch.zeros(V_T, H, dtype=torch.double), probs, argmax, torch.ones(1, T), TTTConfig(num_steps=K))
    mt = out.metrics
    assert mt["num_valid"] == 5
    assert [mt[f"full_acc_{k}"] for k in range(K)] == pytest.approx([0.8, 0.6, 0.2])
    assert [mt[f"cond_acc_{k}"] for k in range(K)] == pytest.approx([0.8, 0.75, 1 / 3])
    assert mt["expected_accept_length"] == pytest.approx(2.6)


def test_ttt_model_forward_is_ttt_loss():
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(7)
    m = tiny_drafter(8, draft_ids)
    cfg = TTTConfig(num_steps=2)
    probs, argmax = draft_labels(m.draft_ids(), logits)
    a = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg)
    b = TTTModel(m, cfg)(aux, input_ids, embed, probs, argmax, loss_mask)
    assert a.loss.item() == b.loss.item() and a.metrics == b.metrics
    assert sorted(TTTModel(m, cfg).state_dict()) == sorted("drafter." + k for k in m.state_dict())


def test_gradients_reach_every_weight_and_not_the_embedding():
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(5)
    m = tiny_drafter(6, draft_ids)
    embed.requires_grad_(False)
    probs, argmax = draft_labels(m.draft_ids(), logits)
    ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, TTTConfig(num_steps=3)).loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert embed.grad is None


def test_padding_carries_no_loss_even_where_its_loss_mask_is_one():
    """A sample padded on the right (attention_mask 0) gives the loss and metrics of the
    sample alone, although every padded position has loss_mask = 1 and a label in the
    draft vocab: only `attention_mask` keeps padding out of the loss."""
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(5, B=1, T=12)
    m = tiny_drafter(6, draft_ids)
    cfg = TTTConfig(num_steps=3)
    T0 = 8  # the real sample; positions T0.. are padding
    logits[0, T0 - 1:, draft_ids] += 50.0  # padded labels (and the last real one) in the draft vocab
    loss_mask[0, T0:] = 1
    attention_mask = torch.zeros_like(input_ids)
    attention_mask[0, :T0] = 1
    probs, argmax = draft_labels(m.draft_ids(), logits)
    padded = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg, attention_mask=attention_mask)
    alone = ttt_loss(m, aux[:, :T0], input_ids[:, :T0], embed, probs[:, :T0], argmax[:, :T0],
                     loss_mask[:, :T0], cfg)
    assert alone.metrics["num_valid"] > 2  # the sample itself carries loss
    assert padded.metrics["num_valid"] == alone.metrics["num_valid"]
    # other tensor shapes, so equal up to rounding
    assert padded.loss.item() == pytest.approx(alone.loss.item(), rel=1e-9)
    for k in range(cfg.num_steps):
        assert padded.metrics[f"loss_{k}"] == pytest.approx(alone.metrics[f"loss_{k}"], rel=1e-9)
        assert padded.metrics[f"full_acc_{k}"] == pytest.approx(alone.metrics[f"full_acc_{k}"])

"""Tests for eagle3/drafter/losses.py: each --loss on distributions small enough to compute by
hand, their gradients, the --loss syntax, the acceptance under sampling, and what ttt_loss
makes of them (padded, masked and out-of-vocabulary positions carry nothing)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fixtures import draft_labels
from test_ttt import H, V_D, V_T, make_batch, tiny_drafter

import eagle3.drafter.losses as losses_module
from eagle3.core.errors import PipelineError
from eagle3.drafter.losses import LossSpec, row_statistics, sampling_acceptance, soft_cross_entropy, step_loss
from eagle3.drafter.ttt import TTTConfig, ttt_loss
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.metrics import MetricSum, fmt

# Two positions over a draft vocabulary of 3. Row 0: p = (.5, .3, .2), q = (.2, .25, .55):
# overlap min = .2 + .25 + .2 = .65. Row 1: p one-hot on token 0, q = (.6, .3, .1): overlap .6.
P = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]], dtype=torch.float64)
Q = torch.tensor([[0.2, 0.25, 0.55], [0.6, 0.3, 0.1]], dtype=torch.float64)
ROWS = torch.tensor([0, 1])
CE = [-(0.5 * math.log(0.2) + 0.3 * math.log(0.25) + 0.2 * math.log(0.55)), -math.log(0.6)]
OVERLAP = [0.65, 0.6]


def logits_of(q: torch.Tensor) -> torch.Tensor:
    return q.log().clone().requires_grad_()  # softmax(log q) = q for a distribution q


def hand_loss(name: str, eta: float = 3.0) -> float:
    ce, tv = sum(CE) / 2, (0.35 + 0.4) / 2
    if name == "kl":
        return ce
    if name == "tv":
        return tv
    if name == "lk_alpha":
        return -(math.log(0.65) + math.log(0.6)) / 2
    lam = math.exp(-eta * (0.65 + 0.6) / 2)  # one weight from the mean overlap 0.625
    return lam * ce + (1 - lam) * tv


@pytest.mark.parametrize("name", ["kl", "tv", "lk_alpha", "lk_lambda"])
def test_each_loss_on_hand_computed_distributions(name):
    loss, ce, pred = step_loss(LossSpec.parse(name), logits_of(Q), P, ROWS)
    assert loss.item() == pytest.approx(hand_loss(name), rel=1e-12)
    assert ce.item() == pytest.approx(sum(CE) / 2, rel=1e-12) and not ce.requires_grad  # every loss reports CE
    assert pred.tolist() == [2, 0]


def test_a_point_mass_label_makes_lk_alpha_the_cross_entropy():
    """-log sum_i min(p_i, q_i) = -log q_y when p is one-hot on y (row 1 alone)."""
    loss, ce, _ = step_loss(LossSpec.parse("lk_alpha"), logits_of(Q[1:]), P, torch.tensor([1]))
    assert loss.item() == pytest.approx(ce.item(), rel=1e-12) == pytest.approx(-math.log(0.6))


def test_lk_lambda_reaches_kl_at_eta_zero_and_tv_at_large_eta():
    z = logits_of(Q)
    assert step_loss(LossSpec.parse("lk_lambda", lk_eta=0.0), z, P, ROWS)[0].item() == pytest.approx(sum(CE) / 2)
    assert step_loss(LossSpec.parse("lk_lambda", lk_eta=1e4), z, P, ROWS)[0].item() == pytest.approx(0.375)


def test_a_weighted_mix_is_the_weighted_sum():
    loss, _, _ = step_loss(LossSpec.parse("kl:0.25,tv:0.75"), logits_of(Q), P, ROWS)
    assert loss.item() == pytest.approx(0.25 * hand_loss("kl") + 0.75 * hand_loss("tv"), rel=1e-12)
    three = step_loss(LossSpec.parse("kl:1,lk_alpha:2,lk_lambda:0.5"), logits_of(Q), P, ROWS)[0]
    assert three.item() == pytest.approx(hand_loss("kl") + 2 * hand_loss("lk_alpha") + 0.5 * hand_loss("lk_lambda"))


def test_tv_gradient_by_hand():
    """d(1 - alpha)/dz_j = -(s_j q_j - q_j sum_i s_i q_i), s_i = [q_i < p_i]; mean over 2 rows.
    Row 0: s = (1, 1, 0), sum s q = .45 -> (-.11, -.1375, +.2475) / 2.
    Row 1: s = (1, 0, 0), sum s q = .6 -> (-(.6 - .36), .18, .06) / 2."""
    z = logits_of(Q)
    step_loss(LossSpec.parse("tv"), z, P, ROWS)[0].backward()
    want = torch.tensor([[-0.11, -0.1375, 0.2475], [-0.24, 0.18, 0.06]], dtype=torch.float64) / 2
    torch.testing.assert_close(z.grad, want, rtol=1e-12, atol=1e-12)


def test_lk_lambda_weight_carries_no_gradient():
    """With lam detached, the gradient is lam * grad(kl) + (1 - lam) * grad(tv)."""
    z = logits_of(Q)
    step_loss(LossSpec.parse("lk_lambda"), z, P, ROWS)[0].backward()
    lam = math.exp(-3.0 * 0.625)
    kl_grad = (Q - P) / 2  # d CE / dz = q - p for a normalised label
    z_tv = logits_of(Q)
    step_loss(LossSpec.parse("tv"), z_tv, P, ROWS)[0].backward()
    torch.testing.assert_close(z.grad, lam * kl_grad + (1 - lam) * z_tv.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_row_statistics_are_the_composed_forms_and_their_gradients(dtype, monkeypatch):
    """The blocked statistics equal the composed cross-entropy and sum(min(p, softmax(z))) with
    their gradients, also for a row whose mass is not 1, an all-zero row and row counts that
    are not a multiple of the block."""
    monkeypatch.setattr(losses_module, "BLOCK_ROWS", 3)
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(7, 11, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    table = torch.softmax(torch.randn(9, 11, generator=g, dtype=torch.float64), dim=-1)
    table[2] *= 1.001
    table[5] = 0.0
    rows = torch.tensor([8, 2, 5, 0, 2, 7, 1])
    weights_ce, weights_overlap = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g,
                                                                                               dtype=torch.float64)
    cross, overlap, argmax = row_statistics(z, table, rows)
    assert torch.equal(argmax, z.detach().argmax(dim=-1))
    (dz,) = torch.autograd.grad((weights_ce * cross).sum() + (weights_overlap * overlap).sum(), z)
    logq = torch.log_softmax(z.double(), dim=-1)
    p = table[rows]
    cross_ref = -(p * logq).sum(-1)
    overlap_ref = torch.minimum(p, logq.exp()).sum(-1)
    (dz_ref,) = torch.autograd.grad((weights_ce * cross_ref).sum() + (weights_overlap * overlap_ref).sum(), z)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(cross.double(), cross_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(overlap.double(), overlap_ref, rtol=tol, atol=tol)
    assert dz.dtype == dtype
    torch.testing.assert_close(dz.double(), dz_ref.to(dtype).double(), rtol=tol, atol=tol)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda z: row_statistics(z, table, rows)[1].sum(), (z,))


def test_plain_kl_is_the_soft_cross_entropy_kernel_bit_for_bit():
    """--loss kl (also spelt kl:1) is today's kernel: the loss is its sum over the count."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 7, generator=g)
    table = torch.softmax(torch.randn(6, 7, generator=g), -1)
    rows = torch.tensor([5, 0, 3, 3, 1])
    want = soft_cross_entropy(z, table, rows)[0] / 5
    for text in ("kl", "kl:1"):
        assert LossSpec.parse(text).plain_kl
        assert torch.equal(step_loss(LossSpec.parse(text), z, table, rows)[0], want)
    assert not LossSpec.parse("kl:0.5").plain_kl


@pytest.mark.parametrize("name", ["kl", "tv", "lk_alpha", "lk_lambda", "kl:0.1,tv:0.9"])
def test_no_position_is_a_zero_loss_that_backpropagates(name):
    z = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)
    loss, ce, pred = step_loss(LossSpec.parse(name), z, P, torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0.0 and ce.item() == 0.0 and pred.numel() == 0
    loss.backward()


def test_lk_alpha_floor_keeps_a_disjoint_row_finite():
    """q = softmax of a logit 800 above the rest underflows the label's token to 0: alpha = 0."""
    z = torch.tensor([[800.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    label = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    loss = step_loss(LossSpec.parse("lk_alpha"), z, label, torch.tensor([0]))[0]
    assert loss.item() == pytest.approx(-math.log(losses_module.ALPHA_FLOOR))
    loss.backward()
    assert torch.isfinite(z.grad).all()


def test_sampling_acceptance_counts_the_mass_outside_the_draft_vocabulary_as_rejected():
    """m p = .8 (.5, .3, .2) = (.4, .24, .16) against q = (.2, .25, .55): .2 + .24 + .16 = .6;
    with all of the target's mass on the draft rows (m = 1) it is the overlap .65."""
    got = sampling_acceptance(Q[[0, 0]].log(), P, torch.tensor([0, 0]), torch.tensor([0.8, 1.0], dtype=torch.float64))
    assert got.tolist() == pytest.approx([0.6, 0.65], rel=1e-12)


@pytest.mark.parametrize("text, terms", [
    ("kl", (("kl", 1.0),)), (" tv ", (("tv", 1.0),)), ("lk_alpha", (("lk_alpha", 1.0),)),
    ("kl:0.1,tv:0.9", (("kl", 0.1), ("tv", 0.9))), ("kl, lk_lambda:2", (("kl", 1.0), ("lk_lambda", 2.0))),
])
def test_loss_syntax(text, terms):
    spec = LossSpec.parse(text, lk_eta=2.0)
    assert spec.terms == terms and spec.lk_eta == 2.0
    assert LossSpec.parse(str(spec), lk_eta=2.0) == spec  # the canonical text reads back


@pytest.mark.parametrize("text, message", [
    ("", "an empty term"), ("kl,", "an empty term"), ("kll", r"unknown loss 'kll' \(did you mean `kl`\?\)"),
    ("kl:x", "weight of kl is 'x', not a number"), ("tv:0", "finite and > 0"), ("tv:-1", "finite and > 0"),
    ("tv:inf", "finite and > 0"), ("tv:nan", "finite and > 0"), ("kl:0.5,kl:0.5", "kl is named twice"),
])
def test_bad_loss_syntax_is_refused_with_the_fix(text, message):
    with pytest.raises(PipelineError, match=message) as e:
        LossSpec.parse(text)
    assert str(e.value).startswith(f"--loss {text!r}: ")  # the flag and the value as given


def test_stage_04_config_validates_and_records_one_spelling():
    cfg = TrainConfig(work_dir=Path("w"), target_model="t", loss="kl:1")
    assert cfg.loss == "kl" and cfg.loss_spec().plain_kl
    assert TrainConfig(work_dir=Path("w"), target_model="t", loss="tv:0.9, kl:0.1").loss == "tv:0.9,kl:0.1"
    with pytest.raises(PipelineError, match=r"TrainConfig.loss \(--loss\) 'jsd': unknown loss"):
        TrainConfig(work_dir=Path("w"), target_model="t", loss="jsd")
    with pytest.raises(PipelineError, match="lk_eta"):
        TrainConfig(work_dir=Path("w"), target_model="t", lk_eta=-1.0)


# -- through ttt_loss --------------------------------------------------------------------
SPECS = ["tv", "lk_alpha", "lk_lambda", "kl:0.3,tv:0.7"]


@pytest.mark.parametrize("name", SPECS)
def test_ttt_loss_is_the_weighted_sum_of_each_steps_loss_over_its_valid_positions(name):
    """loss = sum_k decay^k loss_k, loss_k computed here from the logits of each step at the
    positions an explicit loop finds valid (the index arithmetic of tests/unit/test_ttt.py)."""
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(1)
    m = tiny_drafter(2, draft_ids)
    B, T = input_ids.shape
    K, decay = 3, 0.7
    spec = LossSpec.parse(name)
    probs, argmax = draft_labels(m.draft_ids(), logits)
    out = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, TTTConfig(num_steps=K, step_decay=decay,
                                                                               loss=spec))
    step_logits = []
    original = m.compute_logits
    m.compute_logits = lambda h: step_logits.append(original(h)) or step_logits[-1]
    with torch.no_grad():
        ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, TTTConfig(num_steps=K, loss=spec))
    total = 0.0
    for k in range(K):
        rows = [b * T + t + 1 + k for b in range(B) for t in range(T)
                if t + 2 + k < T and loss_mask[b, t + 2 + k] and int(argmax[b, t + 1 + k]) in draft_ids]
        q = torch.softmax(step_logits[k], -1)  # [N, V_d], the rows in the same (b, t) order
        p = probs.view(B * T, V_D)[rows]
        alpha = torch.minimum(p, q).sum(-1)
        ce = -(p * q.log()).sum(-1).mean()
        tv = (1 - alpha).mean()
        lam = math.exp(-3.0 * alpha.mean().item())
        parts = {"kl": ce, "tv": tv, "lk_alpha": -alpha.log().mean(), "lk_lambda": lam * ce + (1 - lam) * tv}
        loss_k = sum(w * parts[term] for term, w in spec.terms)
        assert out.metrics[f"loss_{k}"] == pytest.approx(float(loss_k), rel=1e-9)
        assert out.metrics[f"ce_{k}"] == pytest.approx(float(ce), rel=1e-9)
        total += decay ** k * float(loss_k)
    assert out.loss.item() == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("name", SPECS)
def test_padded_masked_and_undraftable_positions_carry_nothing(name):
    """For every loss: rewriting the labels of rows whose argmax is outside the draft vocab
    changes nothing; a right-padded sample (loss_mask 1 on the padding) gives the sample's
    loss alone; an all-zero mask gives a zero loss that still backpropagates."""
    cfg = TTTConfig(num_steps=3, loss=LossSpec.parse(name))
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(3)
    m = tiny_drafter(4, draft_ids)
    probs, argmax = draft_labels(m.draft_ids(), logits)
    base = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg)
    outside = ~m.t2d[argmax]
    assert outside.any()
    probs2 = probs.clone()
    probs2[outside] = torch.softmax(torch.randn(int(outside.sum()), V_D, dtype=torch.double), -1)
    assert ttt_loss(m, aux, input_ids, embed, probs2, argmax, loss_mask, cfg).loss.item() == base.loss.item()
    empty = ttt_loss(m, aux, input_ids, embed, probs, argmax, torch.zeros_like(loss_mask), cfg)
    assert empty.loss.item() == 0.0 and empty.metrics["num_valid"] == 0
    empty.loss.backward()

    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(5, B=1, T=12)
    m = tiny_drafter(6, draft_ids)
    T0 = 8
    logits[0, T0 - 1:, draft_ids] += 50.0  # padded labels in the draft vocab
    loss_mask[0, T0:] = 1
    attention_mask = torch.zeros_like(input_ids)
    attention_mask[0, :T0] = 1
    probs, argmax = draft_labels(m.draft_ids(), logits)
    padded = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg, attention_mask=attention_mask)
    alone = ttt_loss(m, aux[:, :T0], input_ids[:, :T0], embed, probs[:, :T0], argmax[:, :T0], loss_mask[:, :T0], cfg)
    assert alone.metrics["num_valid"] > 2
    assert padded.loss.item() == pytest.approx(alone.loss.item(), rel=1e-9)


def test_sampling_metrics_on_a_hand_made_case():
    """T = 6, K = 2, identity mapping, target argmax of row p is p, loss_mask[5] = 0; labels
    one-hot on row p's own token, the drafter puts 0.7 on that token at every valid position,
    and the draft rows hold m = 0.9 of the target's mass except row 3 (0.5). Then step k's
    acceptance at t is min(m[t+1+k], 0.7).

    valid_0 = {0, 1, 2} (t + 2 < 6, token 5 masked): alpha_0 = (.7, .7, .5) -> accept_prob_0 = 1.9/3.
    valid_1 = {0, 1}:                                 alpha_1 = (.7, .5)      -> accept_prob_1 = .6.
    sample_full_acc_0 = 1.9/3; sample_full_acc_1 = (.7 * .7 + .7 * .5 + .5 * 0) / 3 = .28.
    """
    m = tiny_drafter(0)
    T, K = 6, 2
    argmax = torch.arange(T)[None].clone()
    probs = torch.nn.functional.one_hot(torch.arange(T), V_D).double()[None]  # [1, T, V_D]
    loss_mask = torch.ones(1, T)
    loss_mask[0, 5] = 0
    mass = torch.full((1, T), 0.9, dtype=torch.double)
    mass[0, 3] = 0.5
    valid = {0: [0, 1, 2], 1: [0, 1]}
    step = {"k": 0}

    def fake_logits(hidden):
        k = step["k"]
        step["k"] += 1
        assert hidden.shape[0] == len(valid[k])
        q = torch.full((len(valid[k]), V_D), 0.3 / (V_D - 1), dtype=torch.double)
        for i, t in enumerate(valid[k]):
            q[i, t + 1 + k] = 0.7
        return q.log() + 0 * hidden.sum()

    m.compute_logits = fake_logits
    out = ttt_loss(m, torch.zeros(1, T, 3 * H, dtype=torch.double), torch.zeros(1, T, dtype=torch.long),
                   torch.zeros(V_T, H, dtype=torch.double), probs, argmax, loss_mask, TTTConfig(num_steps=K),
                   target_mass=mass)
    mt = out.metrics
    assert [mt["num_valid_0"], mt["num_valid_1"]] == [3, 2]
    assert [mt["accept_prob_0"], mt["accept_prob_1"]] == pytest.approx([1.9 / 3, 0.6])
    assert [mt["sample_full_acc_0"], mt["sample_full_acc_1"]] == pytest.approx([1.9 / 3, 0.28])
    assert mt["sample_accept_length"] == pytest.approx(1 + 1.9 / 3 + 0.28)
    assert [mt["full_acc_0"], mt["full_acc_1"]] == pytest.approx([1.0, 2 / 3])  # greedy: 0.7 is every argmax
    # the mass of rows no valid position reads (row 5: token 5 is masked; row 0: never a label) is unused
    mass[0, 5], mass[0, 0] = 0.01, 0.01
    step["k"] = 0
    again = ttt_loss(m, torch.zeros(1, T, 3 * H, dtype=torch.double), torch.zeros(1, T, dtype=torch.long),
                     torch.zeros(V_T, H, dtype=torch.double), probs, argmax, loss_mask, TTTConfig(num_steps=K),
                     target_mass=mass)
    assert again.metrics == mt


def test_held_out_sums_weight_each_figure_by_its_own_positions():
    """Two batches: accept_prob_k is pooled over step k's positions, sample_full_acc_k over
    step 0's, exactly; the log line shows both figures."""
    a = {"num_valid": 4, "loss_0": 1.0, "loss_1": 2.0, "ce_0": 1.5, "ce_1": 2.5, "full_acc_0": 0.5, "full_acc_1": 0.25,
         "accept_prob_0": 0.5, "accept_prob_1": 0.4, "num_valid_0": 4, "num_valid_1": 2,
         "sample_full_acc_0": 0.5, "sample_full_acc_1": 0.1}
    b = {"num_valid": 1, "loss_0": 3.0, "loss_1": 4.0, "ce_0": 3.5, "ce_1": 4.5, "full_acc_0": 1.0, "full_acc_1": 0.0,
         "accept_prob_0": 1.0, "accept_prob_1": 0.7, "num_valid_0": 1, "num_valid_1": 1,
         "sample_full_acc_0": 1.0, "sample_full_acc_1": 0.7}
    acc = MetricSum(2, sampling=True)
    acc.add(a)
    acc.add(b)
    r = acc.result()
    assert r["accept_prob_0"] == pytest.approx((0.5 * 4 + 1.0) / 5)
    assert r["accept_prob_1"] == pytest.approx((0.4 * 2 + 0.7) / 3)  # step 1's own 2 + 1 positions
    assert r["sample_full_acc_1"] == pytest.approx((0.1 * 4 + 0.7) / 5)
    assert r["sample_accept_length"] == pytest.approx(1 + (0.5 * 4 + 1.0) / 5 + (0.1 * 4 + 0.7) / 5)
    assert r["ce_1"] == pytest.approx((2.5 * 4 + 4.5) / 5) and r["num_valid_1"] == 3
    line = fmt("eval", 10, 20, r, 2)
    assert f"len {r['sample_accept_length']:.3f}" in line and f"accept {r['accept_prob_0']:.3f} " in line
    plain = MetricSum(2)  # training windows: no sampling figures
    plain.add(a)
    assert "sample_accept_length" not in plain.result() and "sampled" not in fmt("train", 1, 2, plain.result(), 2)


def test_checkpointed_steps_give_the_same_loss_and_gradients():
    """--checkpoint-steps recomputes each step in backward; lk_lambda's weight is recomputed from
    the same overlap, so the loss and every gradient are those of the kept activations."""
    draft_ids, input_ids, aux, embed, logits, loss_mask = make_batch(2)
    probs, argmax = draft_labels(tiny_drafter(3, draft_ids).draft_ids(), logits)
    grads = []
    for checkpoint in (False, True):
        m = tiny_drafter(3, draft_ids)
        cfg = TTTConfig(num_steps=3, checkpoint_steps=checkpoint, loss=LossSpec.parse("lk_lambda,tv:0.5"))
        out = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, cfg)
        out.loss.backward()
        grads.append((out.loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    for name in grads[0][1]:
        torch.testing.assert_close(grads[0][1][name], grads[1][1][name], rtol=1e-10, atol=1e-12)

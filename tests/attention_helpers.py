"""Two drafters with the same weights (the linear-memory attention and the reference one),
a random TTT batch, and their loss and gradients compared: shared by the attention tests
(tests/unit/test_ttt_attention.py, test_attention_kernel_contract.py).

Float64 throughout; two different computations are compared with `TOL64`.
"""
from __future__ import annotations

import torch
from fixtures import draft_labels

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt import TTTConfig, ttt_loss

V_T, V_D, H = 40, 16, 32
TOL64 = dict(rtol=1e-9, atol=1e-10)


def pair(nkv: int, seed: int = 0, dtype=torch.double) -> tuple[Eagle3Drafter, Eagle3Drafter]:
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=nkv, head_dim=8,
                        intermediate_size=48, target_hidden_size=H, draft_vocab_size=V_D,
                        target_vocab_size=V_T, max_position_embeddings=64)
    torch.manual_seed(seed)
    new = Eagle3Drafter(cfg).to(dtype)
    with torch.no_grad():  # sharper attention than the init's, so the softmax is not near uniform
        new.midlayer.self_attn.q_proj.weight.mul_(4)
    ref = Eagle3Drafter(cfg, attention="reference").to(dtype)
    ref.load_state_dict(new.state_dict())
    return new, ref


def batch(seed: int, B: int, T: int, dtype=torch.double):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V_T, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g, dtype=dtype)
    embed = torch.randn(V_T, H, generator=g, dtype=dtype)
    logits = 3 * torch.randn(B, T, V_T, generator=g, dtype=dtype)
    logits[..., :V_D] += 2.0
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).long()
    return input_ids, aux, embed, logits, loss_mask


def loss_and_grads(m: Eagle3Drafter, b, K: int, **kw):
    input_ids, aux, embed, logits, loss_mask = b
    aux = aux.clone().requires_grad_()
    probs, argmax = draft_labels(m.draft_ids(), logits)
    m.zero_grad()
    out = ttt_loss(m, aux, input_ids, embed, probs, argmax, loss_mask, TTTConfig(num_steps=K), **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    grads["aux"] = aux.grad.clone()
    return out, grads


def assert_same(a, b, tol):
    (oa, ga), (ob, gb) = a, b
    torch.testing.assert_close(oa.loss, ob.loss, **tol)
    assert oa.metrics["num_valid"] == ob.metrics["num_valid"] > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], **tol, msg=lambda m: f"{name}: {m}")

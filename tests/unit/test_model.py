"""Tests for eagle3/drafter/model.py: names, shapes, and the forward against an independent reference."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache

EXPECTED_KEYS = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, target_hidden_size=32, draft_vocab_size=20,
                target_vocab_size=50, max_position_embeddings=128, rope_theta=10000.0)
    base.update(kw)
    return DrafterConfig(**base)


# Rope tables are fp32 (as in the engines), so a float64 model matches the float64
# reference to ~1e-7, not to float64 precision.
TOL = dict(rtol=1e-5, atol=1e-6)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg).double()
    # Norm weights start at 1; randomise them so the test sees each one applied in its place.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m


# ---------------------------------------------------------------- names, shapes, config


def test_state_dict_keys_and_shapes_are_the_engine_names():
    cfg = tiny_config()
    m = Eagle3Drafter(cfg)
    sd = m.state_dict()
    assert sorted(sd) == sorted(EXPECTED_KEYS)
    assert not any("embed" in k for k in sd)
    H, nh, nkv, D = 32, 4, 2, 8
    assert sd["fc.weight"].shape == (H, 3 * H)
    for k, rows in (("q", nh * D), ("k", nkv * D), ("v", nkv * D)):
        assert sd[f"midlayer.self_attn.{k}_proj.weight"].shape == (rows, 2 * H)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, nh * D)
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (48, H)
    assert sd["midlayer.mlp.down_proj.weight"].shape == (H, 48)
    assert sd["lm_head.weight"].shape == (20, H)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (20,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (50,)
    # No bias anywhere; a fresh drafter's mapping is the identity on the first 20 ids.
    assert not any(k.endswith("bias") for k in sd)
    assert torch.equal(m.draft_ids(), torch.arange(20))
    # bf16 cast keeps the mapping integer/bool and state_dict loadable into a fresh model.
    m2 = Eagle3Drafter(cfg)
    m2.load_state_dict(m.to(torch.bfloat16).state_dict())
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool


def test_config_roundtrip_and_validation():
    cfg = tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(PipelineError, match="num_key_value_heads"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(PipelineError, match="target_hidden_size"):
        tiny_config(target_hidden_size=64)
    with pytest.raises(PipelineError, match="draft_vocab_size"):
        tiny_config(draft_vocab_size=51)
    with pytest.raises(PipelineError, match="head_dim"):
        tiny_config(head_dim=7)
    with pytest.raises(PipelineError, match="rope_scaling"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(PipelineError, match="unknown key"):
        DrafterConfig.from_dict({**cfg.to_dict(), "vocab_size": 3})


def test_set_vocab_mapping_accepts_convention_2_and_refuses_others():
    m = Eagle3Drafter(tiny_config())
    ids = torch.tensor(sorted(torch.randperm(50, generator=torch.Generator().manual_seed(1))[:20].tolist()))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab_mapping(ids - torch.arange(20), t2d)
    assert torch.equal(m.draft_ids(), ids)
    bad = t2d.clone()
    bad[ids[0]] = False
    bad[(~t2d).nonzero()[0]] = True
    with pytest.raises(PipelineError, match="stage 03"):
        m.set_vocab_mapping(ids - torch.arange(20), bad)
    with pytest.raises(PipelineError, match="shapes"):
        m.set_vocab_mapping(torch.zeros(19, dtype=torch.long), t2d)


def test_aux_width_mismatch_is_refused():
    m = Eagle3Drafter(tiny_config())
    with pytest.raises(PipelineError, match="aux"):
        m.project_aux(torch.zeros(1, 4, 64))


# ---------------------------------------------------------------- independent reference


def ref_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """x [B, heads, T, D]; pairs (i, i + D/2) rotated by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    out = torch.empty_like(x)
    for i in range(half):
        ang = pos.double()[:, None, :] * theta ** (-2.0 * i / D)  # [B, 1, T]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., i + half] = b * torch.cos(ang) + a * torch.sin(ang)
    return out


def ref_unroll(m: Eagle3Drafter, aux, embeds_per_step):
    """TTT with one flat sequence of K*T keys and a full mask: the shape the model avoids.

    Query (k, t) may see key (0, s) for s <= t and key (j, t) for 1 <= j <= k.
    Step k's rope position is t + k. Returns the list of outputs fed to the next step: pre-norm,
    or post-norm for EAGLE 3.1 (`norm_output`), whose aux layers are also normed one by one.
    """
    c = m.config
    sd = {k: v for k, v in m.state_dict().items()}
    B, T, H = embeds_per_step[0].shape
    nh, nkv, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    G = nh // nkv
    pos = torch.arange(T).expand(B, T)
    if c.fc_norm:  # vLLM's combine_hidden_states: chunk, norm each with its own weight, concatenate
        Ht = c.target_hidden_size
        aux = torch.cat([ref_rms(aux[..., i * Ht:(i + 1) * Ht], sd[f"fc_norm.{i}.weight"], eps)
                         for i in range(c.num_aux_layers)], -1)
    h = aux @ sd["fc.weight"].T
    ks, vs, outs = [], [], []
    for k, emb in enumerate(embeds_per_step):
        x = torch.cat([ref_rms(emb, sd["midlayer.input_layernorm.weight"], eps),
                       ref_rms(h, sd["midlayer.hidden_norm.weight"], eps)], -1)
        q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(B, T, nh, D).transpose(1, 2)
        kk = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(B, T, nkv, D).transpose(1, 2)
        vv = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(B, T, nkv, D).transpose(1, 2)
        q = ref_rope(q, pos + k, c.rope_theta)
        kk = ref_rope(kk, pos + k, c.rope_theta)
        ks.append(kk.repeat_interleave(G, dim=1))
        vs.append(vv.repeat_interleave(G, dim=1))
        K_all = torch.cat(ks, dim=2)  # [B, nh, (k+1)*T, D]
        V_all = torch.cat(vs, dim=2)
        mask = torch.zeros(B, T, (k + 1) * T, dtype=torch.bool)
        for t in range(T):
            mask[:, t, : t + 1] = True
            for j in range(1, k + 1):
                mask[:, t, j * T + t] = True
        scores = q @ K_all.transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        attn = torch.softmax(scores, -1) @ V_all  # [B, nh, T, D]
        attn = attn.transpose(1, 2).reshape(B, T, nh * D) @ sd["midlayer.self_attn.o_proj.weight"].T
        h1 = h + attn
        y = ref_rms(h1, sd["midlayer.post_attention_layernorm.weight"], eps)
        g = y @ sd["midlayer.mlp.gate_proj.weight"].T
        u = y @ sd["midlayer.mlp.up_proj.weight"].T
        out = h1 + (g * torch.sigmoid(g) * u) @ sd["midlayer.mlp.down_proj.weight"].T
        if c.norm_output:  # the engines' `aux_output = hidden_states` (post-norm) branch
            out = ref_rms(out, sd["norm.weight"], eps)
        outs.append(out)
        h = out
    return outs


def run_unroll(m: Eagle3Drafter, aux, embeds_per_step, **kw):
    cache = TTTCache()
    h = m.project_aux(aux)
    outs = []
    for emb in embeds_per_step:
        h = m.step(emb, h, cache, **kw)
        outs.append(h)
    return outs


def test_step0_forward_matches_reference():
    cfg = tiny_config()
    m = random_drafter(cfg)
    torch.manual_seed(1)
    B, T = 2, 7
    aux, emb = torch.randn(B, T, 96, dtype=torch.double), torch.randn(B, T, 32, dtype=torch.double)
    logits, hidden = m(aux, emb)
    (ref,) = ref_unroll(m, aux, [emb])
    torch.testing.assert_close(hidden, ref, **TOL)
    sd = m.state_dict()
    ref_logits = ref_rms(ref, sd["norm.weight"], cfg.rms_norm_eps) @ sd["lm_head.weight"].T
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert logits.shape == (B, T, 20)


@pytest.mark.parametrize("fc_norm, norm_output", [(True, True), (True, False), (False, True)],
                         ids=["eagle3.1", "fc_norm-only", "norm_output-only"])
def test_eagle31_norms_sit_where_the_engines_put_them(fc_norm, norm_output):
    """fc_norm: one RMSNorm per aux layer before fc; norm_output: the post-norm state feeds the
    next step and lm_head, normed once (vLLM/SGLang llama_eagle3.py; each switch on its own too)."""
    cfg = tiny_config(fc_norm=fc_norm, norm_output=norm_output)
    m = random_drafter(cfg, seed=5)
    assert (m.fc_norm is not None) == fc_norm
    torch.manual_seed(6)
    B, T, K = 2, 6, 3
    aux = torch.randn(B, T, 96, dtype=torch.double) * torch.tensor([0.1, 1.0, 30.0]).repeat_interleave(32)
    embs = [torch.randn(B, T, 32, dtype=torch.double) for _ in range(K)]
    got, want = run_unroll(m, aux, embs), ref_unroll(m, aux, embs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    sd = m.state_dict()
    logits = m.compute_logits(got[1])
    final = want[1] if norm_output else ref_rms(want[1], sd["norm.weight"], cfg.rms_norm_eps)
    torch.testing.assert_close(logits, final @ sd["lm_head.weight"].T, **TOL)
    # The plain shape's computation on the same weights is another network: the test can tell.
    plain = random_drafter(tiny_config(), seed=5)
    plain.load_state_dict({k: v for k, v in sd.items() if not k.startswith("fc_norm.")})
    assert (run_unroll(plain, aux, embs)[1] - got[1]).abs().max() > 1e-2


def test_eagle31_state_dict_adds_one_norm_per_aux_layer():
    m = Eagle3Drafter(tiny_config(fc_norm=True, norm_output=True, num_aux_layers=4))
    sd = m.state_dict()
    norms = [f"fc_norm.{i}.weight" for i in range(4)]
    assert sorted(sd) == sorted(EXPECTED_KEYS + norms)
    assert all(sd[n].shape == (32,) and bool((sd[n] == 1).all()) for n in norms)  # target_hidden_size, ones
    assert "fc_norm.0.weight" not in Eagle3Drafter(tiny_config(norm_output=True)).state_dict()  # no tensor of its own
    cfg = tiny_config(fc_norm=True, norm_output=True)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    # a checkpoint written before the shape existed has neither key: a plain drafter
    old = {k: v for k, v in tiny_config().to_dict().items() if k not in ("fc_norm", "norm_output")}
    assert DrafterConfig.from_dict(old) == tiny_config()
    with pytest.raises(PipelineError, match="fc_norm = 'yes'"):
        tiny_config(fc_norm="yes")


@pytest.mark.parametrize("nkv", [4, 2, 1])
def test_ttt_unroll_matches_full_mask_reference(nkv):
    cfg = tiny_config(num_key_value_heads=nkv)
    m = random_drafter(cfg, seed=nkv)
    torch.manual_seed(2)
    B, T, K = 2, 6, 4
    aux = torch.randn(B, T, 96, dtype=torch.double)
    embs = [torch.randn(B, T, 32, dtype=torch.double) for _ in range(K)]
    for got, want in zip(run_unroll(m, aux, embs), ref_unroll(m, aux, embs)):
        torch.testing.assert_close(got, want, **TOL)


def test_ttt_attention_is_causal_and_sees_own_earlier_steps():
    m = random_drafter(tiny_config())
    torch.manual_seed(3)
    B, T, K, t = 1, 8, 3, 4
    aux = torch.randn(B, T, 96, dtype=torch.double)
    embs = [torch.randn(B, T, 32, dtype=torch.double) for _ in range(K)]
    base = run_unroll(m, aux, embs)

    # Anything at positions > t, at any step, leaves every step's output at <= t alone.
    aux2 = aux.clone()
    aux2[:, t + 1:] += 5
    embs2 = [e.clone() for e in embs]
    for e in embs2:
        e[:, t + 1:] += 5
    pert = run_unroll(m, aux2, embs2)
    for k in range(K):
        torch.testing.assert_close(pert[k][:, : t + 1], base[k][:, : t + 1])
        assert not torch.allclose(pert[k][:, t + 1:], base[k][:, t + 1:])

    # Step 1's input at position t changes step 2 at t (same-position attention) but
    # no other position: later steps never read other positions' draft steps.
    embs3 = [e.clone() for e in embs]
    embs3[1][:, t] += 5
    pert = run_unroll(m, aux, embs3)
    torch.testing.assert_close(pert[0], base[0])
    others = [s for s in range(T) if s != t]
    for k in (1, 2):
        assert not torch.allclose(pert[k][:, t], base[k][:, t])
        torch.testing.assert_close(pert[k][:, others], base[k][:, others])


def test_attention_through_step_k_cache_uses_step1_keys():
    """Step 2's attention weight on step 1's key: zero the step-1 value path, output changes."""
    m = random_drafter(tiny_config())
    torch.manual_seed(4)
    B, T = 1, 5
    aux = torch.randn(B, T, 96, dtype=torch.double)
    embs = [torch.randn(B, T, 32, dtype=torch.double) for _ in range(3)]
    cache = TTTCache()
    h = m.project_aux(aux)
    h = m.step(embs[0], h, cache)
    h = m.step(embs[1], h, cache)
    cache_b = TTTCache(keys=list(cache.keys), values=[cache.values[0], torch.zeros_like(cache.values[1])])
    out_a = m.step(embs[2], h, cache)
    out_b = m.step(embs[2], h, cache_b)
    assert cache.num_steps == 3 and cache.keys[2].shape == (B, 2, T, 8)
    assert not torch.allclose(out_a, out_b)


def test_padding_mask_matches_unpadded_rows_and_stays_finite():
    m = random_drafter(tiny_config())
    torch.manual_seed(5)
    T, L, K = 8, 5, 3  # row 1 is L real tokens + right padding
    aux = torch.randn(2, T, 96, dtype=torch.double)
    embs = [torch.randn(2, T, 32, dtype=torch.double) for _ in range(K)]
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, L:] = 0
    padded = run_unroll(m, aux, embs, attention_mask=mask)
    alone = run_unroll(m, aux[1:, :L], [e[1:, :L] for e in embs])
    full = run_unroll(m, aux[:1], [e[:1] for e in embs])
    for k in range(K):
        assert torch.isfinite(padded[k]).all()
        torch.testing.assert_close(padded[k][1:, :L], alone[k])
        torch.testing.assert_close(padded[k][:1], full[k])
    # Left padding works too when position ids say where the sequence starts.
    lmask = torch.zeros(1, T, dtype=torch.long)
    lmask[0, T - L:] = 1
    pos = (torch.arange(T) - (T - L)).clamp(min=0)[None]
    left = run_unroll(m, aux[1:].roll(T - L, 1), [e[1:].roll(T - L, 1) for e in embs],
                      attention_mask=lmask, position_ids=pos)
    for k in range(K):
        torch.testing.assert_close(left[k][:, T - L:], alone[k])


def test_rope_is_invariant_to_a_constant_position_offset():
    """RoPE is relative: offsetting every position id changes no output, so left padding
    and chunked sequences are safe. (That step k runs at t + k is checked against the
    reference in test_ttt_unroll_matches_full_mask_reference.)"""
    m = random_drafter(tiny_config())
    torch.manual_seed(6)
    B, T = 1, 6
    aux = torch.randn(B, T, 96, dtype=torch.double)
    embs = [torch.randn(B, T, 32, dtype=torch.double) for _ in range(2)]
    a = run_unroll(m, aux, embs)
    b = run_unroll(m, aux, embs, position_ids=torch.arange(T)[None] + 11)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_llama3_rope_scaling_keeps_high_frequencies():
    cfg = tiny_config(head_dim=16, num_attention_heads=2, num_key_value_heads=2,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    from eagle3.drafter.model import rope_inv_freq

    plain = rope_inv_freq(tiny_config(head_dim=16, num_attention_heads=2, num_key_value_heads=2))
    scaled = rope_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    torch.testing.assert_close(scaled[wavelen < 16], plain[wavelen < 16])  # 64 / high_freq_factor
    torch.testing.assert_close(scaled[wavelen > 64], plain[wavelen > 64] / 8)

"""The one-layer EAGLE-3 drafter: modules only (no file I/O, no data, no target).

`Eagle3Drafter` holds exactly the tensors that SGLang's and vLLM's
`LlamaForCausalLMEagle3` load (docs/CONVENTIONS.md §6), under the same names and
with no prefix, so export is a dtype cast plus a save:

    fc.weight                                  [H, A*H_t]   fuses the A aux layers
    midlayer.input_layernorm.weight            [H]          normalises the token embedding
    midlayer.hidden_norm.weight                [H]          normalises the hidden input
    midlayer.self_attn.{q,k,v}_proj.weight     [*, 2H]      attention reads cat(embed, hidden)
    midlayer.self_attn.o_proj.weight           [H, nh*D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.{gate,up,down}_proj.weight                 SiLU-gated MLP
    norm.weight                                [H]
    lm_head.weight                             [V_d, H]     row i predicts target id i + d2t[i]
    d2t  int64 [V_d], t2d  bool [V_t]                       vocab mapping (convention 2)

There is no `embed_tokens`: both engines feed the drafter the target's own
embedding, so the caller looks tokens up in the frozen target embedding and passes
the vectors in.

One draft step (`Eagle3Drafter.step`) over a whole sequence computes

    x   = cat(input_layernorm(embed), hidden_norm(h))      # h = fc(aux) at step 0
    h1  = h + o_proj(attn(x))                               # residual is the un-normed h
    out = h1 + mlp(post_attention_layernorm(h1))            # pre-norm: next step's h
    logits = lm_head(norm(out))                             # `compute_logits`

The EAGLE 3.1 shape (`DrafterConfig.fc_norm`, `.norm_output`; docs/CONVENTIONS.md §6)
adds two norms where vLLM's and SGLang's `llama_eagle3.py` put them:

    fc_norm.{i}.weight                         [H_t]        one RMSNorm per aux layer
    h   = fc(cat(fc_norm.0(aux_0), ..., fc_norm.{A-1}(aux_{A-1})))   # step 0's hidden input
    out = norm(h1 + mlp(...))                               # norm_output: the post-norm
                                                            # state is the next step's h
    logits = lm_head(out)                                   # and is not normed again

`norm_output` adds no tensor: the final `norm` moves from the logits alone onto the
state that feeds the next step, so `step` returns the post-norm state and
`compute_logits` skips its norm; callers (the TTT loop) stay the same.

Train-time test (TTT) runs K such steps over the same T positions; a `TTTCache`
carries each step's keys/values so that step k at position t attends to step 0's
keys at positions <= t plus steps 1..k's keys at position t. That attention, in its
two implementations (the linear-memory default and the O(T^2) reference the tests
compare against), is eagle3/drafter/ttt_attention.py.

Padding: pass `attention_mask [B, T]` (1 = real token); right padding needs nothing
else, other layouts pass `position_ids`. Packing: several samples in one row, each
with positions restarting at 0, pass `segment_ids [B, T]` (which sample of the row
each token belongs to); attention never crosses from one sample into another
(block-diagonal causal).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.artifacts.vocab_map import target_ids
from eagle3.core.errors import PipelineError
from eagle3.drafter.ttt_attention import (ATTENTION_IMPLS, AttnLayout, TTTCache, allowed_mask, attention_runs,
                                          merged_attention, reference_attention)

# rope_scaling types this module implements; anything else is refused rather than
# silently trained with positions the engine would compute differently.
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclass
class DrafterConfig:
    """The drafter's shape; saved beside every checkpoint and mapped to config.json on export."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    # At least the target's context (262144 for Kimi-K2.5): SGLang refuses a shorter
    # draft context and vLLM sizes its rope cache from it.
    max_position_embeddings: int
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # EAGLE 3.1 (eagle3/drafter/shape.py names the shapes): an RMSNorm on each aux layer before
    # fc, and the post-norm output fed to the next draft step. The config.json keys of the
    # same names switch them on in vLLM and SGLang.
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        positive = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "target_hidden_size", "draft_vocab_size",
                    "target_vocab_size", "max_position_embeddings", "num_aux_layers")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PipelineError(f"DrafterConfig.{name} = {v!r}; it must be a positive integer.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise PipelineError(
                f"DrafterConfig: num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}; pick a divisor of the head count "
                f"(equal for plain multi-head attention).")
        if self.head_dim % 2:
            raise PipelineError(f"DrafterConfig.head_dim = {self.head_dim}; RoPE needs an even head_dim.")
        if self.hidden_size != self.target_hidden_size:
            raise PipelineError(
                f"DrafterConfig: hidden_size = {self.hidden_size} differs from target_hidden_size = "
                f"{self.target_hidden_size}. The drafter has no embed_tokens and reuses the target's "
                f"embedding (width target_hidden_size), so set hidden_size = target_hidden_size.")
        if self.draft_vocab_size > self.target_vocab_size:
            raise PipelineError(
                f"DrafterConfig: draft_vocab_size = {self.draft_vocab_size} exceeds target_vocab_size = "
                f"{self.target_vocab_size}; the draft vocabulary is a subset of the target's, lower it.")
        for name in ("fc_norm", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise PipelineError(f"DrafterConfig.{name} = {getattr(self, name)!r}; it must be true or false.")
        if not self.rms_norm_eps > 0:
            raise PipelineError(f"DrafterConfig.rms_norm_eps = {self.rms_norm_eps}; it must be > 0 (e.g. 1e-6).")
        if not self.rope_theta > 0:
            raise PipelineError(f"DrafterConfig.rope_theta = {self.rope_theta}; it must be > 0 (e.g. 10000.0).")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES:
                raise PipelineError(
                    f"DrafterConfig.rope_scaling type {kind!r} is not implemented; use None or one of "
                    f"{list(ROPE_SCALING_TYPES)} (e.g. {{'rope_type': 'linear', 'factor': 2.0}}).")
            if not float(self.rope_scaling.get("factor", 0)) > 0:
                raise PipelineError(f"DrafterConfig.rope_scaling = {self.rope_scaling} needs a 'factor' > 0.")
            if kind in ("llama3", "yarn"):
                need = (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                        if kind == "llama3" else ("original_max_position_embeddings",))
                missing = [k for k in need if k not in self.rope_scaling]
                if missing:
                    raise PipelineError(
                        f"DrafterConfig.rope_scaling = {self.rope_scaling} ({kind}) lacks {missing}; "
                        f"copy them from the target's config.json.")

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PipelineError(
                f"DrafterConfig.from_dict: unknown key(s) {unknown}; valid keys are {sorted(names)}. "
                f"(A Hugging Face config.json needs the export module's mapping, not this.)")
        return cls(**d)


def autocast_once(x: Tensor) -> Tensor:
    """`x` as autocast would hand it to a matmul (fp32 -> its dtype; else unchanged).

    Call it once on an input that several linears read (q/k/v, gate/up): each would
    otherwise cast its own copy of the same [B, T, ...] tensor, with the same values.
    """
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the engines' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(config: DrafterConfig) -> Tensor:
    """Inverse frequencies [D/2] of Llama-style (neox, rotate-half) RoPE, with optional scaling."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [D/2]
    rs = config.rope_scaling
    if rs is None:
        return inv.float()
    kind = rs.get("rope_type", rs.get("type"))
    factor = float(rs["factor"])
    if kind == "linear":
        return (inv / factor).float()
    if kind == "yarn":
        # YaRN as vLLM 0.32 computes it for a Llama layer (model_executor/layers/rotary_embedding/
        # yarn_scaling_rope.py, common.py): dims that turn fewer than beta_slow times over the
        # original context are interpolated (/ factor), more than beta_fast times kept, a linear
        # ramp between; the ramp ends are floored/ceiled unless "truncate" is false.
        old_ctx = float(rs["original_max_position_embeddings"])
        fast, slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

        def dim_at(rotations: float) -> float:  # the dim index that turns `rotations` times over old_ctx
            return d * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = dim_at(fast), dim_at(slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [D/2]
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
        return (inv / factor * (1 - keep) + inv * keep).float()
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, scaled)
    out = torch.where(wavelen < old_ctx / high, inv, out)
    return out.float()


def rope_attention_factor(config: DrafterConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other rope), as vLLM 0.32 takes
    it: `attention_factor` when given; else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    when both are set (1.0 for Kimi-K2.5's mscale = mscale_all_dim = 1); else 0.1 ln(factor) + 1."""
    rs = config.rope_scaling
    if rs is None or rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    factor = float(rs["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(float(rs["mscale"])) / mscale(float(rs["mscale_all_dim"]))
    return mscale()


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos/sin tables for integer positions [B, T] -> two [B, T, D] tensors (times `scale`, YaRN's)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T] -> [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D/2] -> [B, T, D]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [B, heads, T, D] with cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]  # cos [B, T, D] -> [B, 1, T, D] broadcast over heads


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2H inputs (embedding and hidden side by side)."""

    def __init__(self, config: DrafterConfig, impl: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.impl = impl
        H, nh, nkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * H, nh * D, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.o_proj = nn.Linear(nh * D, H, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache, layout: AttnLayout) -> Tensor:
        B, T, _ = x.shape
        c = self.config
        nkv, G, D = c.num_key_value_heads, c.num_kv_groups, c.head_dim
        x = autocast_once(x)  # read by three projections
        q = self.q_proj(x).view(B, T, c.num_attention_heads, D).transpose(1, 2)  # [B, T, 2H] -> [B, nh, T, D]
        k = self.k_proj(x).view(B, T, nkv, D).transpose(1, 2)  # [B, T, 2H] -> [B, n_kv, T, D]
        v = self.v_proj(x).view(B, T, nkv, D).transpose(1, 2)  # [B, T, 2H] -> [B, n_kv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.keys.append(k)
        cache.values.append(v)
        if self.impl == "sdpa":
            out = merged_attention(q, cache, layout.runs, 1.0 / math.sqrt(D))  # -> [B, nh, T, D]
            out = out.transpose(1, 2).reshape(B, T, c.num_attention_heads * D)  # -> [B, T, nh*D]
            return self.o_proj(out)  # [B, T, nh*D] -> [B, T, H]
        # Query head i*G + j uses kv head i (Hugging Face's repeat_kv order).
        q = q.reshape(B, nkv, G, T, D)  # [B, nh, T, D] -> [B, n_kv, G, T, D]
        out = reference_attention(q, cache, layout.allowed, 1.0 / math.sqrt(D))  # -> [B, n_kv, G, T, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(B, T, c.num_attention_heads * D)  # -> [B, T, nh*D]
        return self.o_proj(out)  # [B, T, nh*D] -> [B, T, H]


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = autocast_once(x)  # read by two projections
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, H] -> [B, T, I] -> [B, T, H]


class Eagle3DecoderLayer(nn.Module):
    """The `midlayer`: a Llama decoder layer whose attention input is cat(embed, hidden)."""

    def __init__(self, config: DrafterConfig, attention: str = "sdpa") -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config, attention)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                cache: TTTCache, layout: AttnLayout) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # 2 x [B, T, H] -> [B, T, 2H]
        h = hidden + self.self_attn(x, cos, sin, cache, layout)  # residual is the un-normed hidden input
        return h + self.mlp(self.post_attention_layernorm(h))  # pre-norm output, [B, T, H]


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 drafter; `state_dict()` keys are the engines' tensor names (see module doc).

    `attention` picks the TTT attention implementation (module doc): "sdpa" (default,
    linear memory) or "reference"; it changes no weight.
    """

    def __init__(self, config: DrafterConfig, attention: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        # EAGLE 3.1: one norm per aux layer (`fc_norm.{i}.weight`, the engines' names); a plain
        # EAGLE-3 drafter has no such module, so its state dict stays what it was.
        self.fc_norm = (nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_aux_layers))
                        if c.fc_norm else None)
        self.midlayer = Eagle3DecoderLayer(c)
        self.set_attention(attention)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Identity mapping until a real one is set: draft id i is target id i.
        t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)
        # Not a buffer: `.to(torch.bfloat16)` would round the frequencies along with the
        # weights and shift every rotation; it is moved to the input's device per step.
        self._inv_freq = rope_inv_freq(c)
        self._rope_scale = rope_attention_factor(c)

    def set_attention(self, attention: str) -> None:
        """Switch the TTT attention implementation ("sdpa" or "reference"); no weight changes."""
        if attention not in ATTENTION_IMPLS:
            raise PipelineError(f"attention = {attention!r}; use one of {list(ATTENTION_IMPLS)}.")
        self.attention = attention
        self.midlayer.self_attn.impl = attention

    # -- vocabulary mapping (convention 2) --------------------------------------

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a draft vocabulary; refuses a mapping that is not convention 2's."""
        c = self.config
        if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.target_vocab_size,):
            raise PipelineError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the drafter "
                f"({c.draft_vocab_size},), ({c.target_vocab_size},); rebuild the mapping (stage 03) with "
                f"draft_vocab_size={c.draft_vocab_size} for this target.")
        d2t = d2t.to(torch.int64)
        t2d = t2d.to(torch.bool)
        ids = target_ids(d2t.cpu())  # target id of each draft row
        ok = bool((ids >= 0).all() and (ids < c.target_vocab_size).all())
        ok = ok and bool((ids[1:] > ids[:-1]).all()) and int(t2d.sum()) == c.draft_vocab_size
        ok = ok and bool(t2d.cpu()[ids.clamp(0, c.target_vocab_size - 1)].all())
        if not ok:
            raise PipelineError(
                "vocab mapping is inconsistent: target ids i + d2t[i] must be ascending, in range, and "
                "exactly the ids where t2d is true; rebuild it with stage 03 (03_build_vocab_mapping.py).")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_ids(self) -> Tensor:
        """Target id of each draft row, `arange(V_d) + d2t` (SGLang's hot_token_id) -> [V_d]."""
        return target_ids(self.d2t)

    # -- forward pieces -----------------------------------------------------------

    def project_aux(self, aux: Tensor) -> Tensor:
        """Fuse the target's aux hidden states: [B, T, A*H_t] -> [B, T, H] (step 0's hidden input)."""
        if aux.shape[-1] != self.fc.in_features:
            raise PipelineError(
                f"aux hidden states have width {aux.shape[-1]}, the drafter expects num_aux_layers * "
                f"target_hidden_size = {self.fc.in_features}; the extraction (stage 02) and the drafter "
                f"config disagree on the aux layers or the target.")
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            # EAGLE 3.1: each aux layer normed on its own, so the deepest (largest) one no
            # longer dominates the fused input
            chunks = aux.split(self.config.target_hidden_size, dim=-1)  # [B, T, A*H_t] -> A x [B, T, H_t]
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)  # -> [B, T, A*H_t]
        return self.fc(aux)  # [B, T, A*H_t] -> [B, T, H]

    def step(self, embeds: Tensor, hidden: Tensor, cache: TTTCache, *,
             attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
             segment_ids: Tensor | None = None) -> Tensor:
        """One draft step over all T positions; returns the next step's hidden input [B, T, H]:
        the pre-norm output, or with `norm_output` (EAGLE 3.1) the post-norm one.

        embeds [B, T, H]: target-embedding vectors of the tokens this step reads;
        hidden [B, T, H]: `project_aux(aux)` for the first step, else the previous
        step's output. The step index k is `cache.num_steps` on entry.
        segment_ids [B, T]: for packed rows, the sample each token belongs to; pass
        position_ids restarting at 0 per sample with it.

        RoPE position of step k at position t is `position_ids[t] + k`. That is what
        both engines run: the first draft forward places (aux at t, token t+1) at
        position t, and every further draft step advances positions by one while
        keeping the earlier draft tokens in the KV cache. So at inference the
        step-k query sits at t+k, the context keys at s <= t and step j's key at
        t+j; training with the same positions trains the same relative distances
        (t+k-s, k-j) the engine will present. Reusing t for every step would train
        distances the drafter never sees when serving.
        """
        B, T, _ = embeds.shape
        # stage 04 checks the target embedding's width against the drafter's hidden_size
        assert hidden.shape == embeds.shape, f"embeds {tuple(embeds.shape)} and hidden {tuple(hidden.shape)} differ"
        k = cache.num_steps
        if position_ids is None:
            position_ids = torch.arange(T, device=embeds.device).expand(B, T)  # [T] -> [B, T]
        inv_freq = self._inv_freq.to(embeds.device)
        cos, sin = rope_cos_sin(position_ids + k, inv_freq, hidden.dtype, self._rope_scale)  # [B, T] -> 2 x [B, T, D]
        if self.attention == "sdpa":
            layout = AttnLayout(runs=attention_runs(attention_mask, segment_ids, T))
        else:
            layout = AttnLayout(allowed=allowed_mask(B, T, attention_mask, segment_ids, embeds.device))
        out = self.midlayer(embeds.to(hidden.dtype), hidden, cos, sin, cache, layout)
        return self.norm(out) if self.config.norm_output else out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocab logits from `step`'s outputs: [..., H] -> [..., V_d]. With `norm_output`
        they are normed already (the engines feed the same state to lm_head and the next step)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def forward(self, aux: Tensor, embeds: Tensor, *, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, segment_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Step 0 only (no unroll): returns (logits [B, T, V_d], the next step's hidden input [B, T, H])."""
        hidden = self.step(embeds, self.project_aux(aux), TTTCache(), attention_mask=attention_mask,
                           position_ids=position_ids, segment_ids=segment_ids)
        return self.compute_logits(hidden), hidden

"""Train-time test (TTT): the K-step unroll, its loss and its metrics. Pure tensors.

Reads nothing from disk. The training loop (eagle3 train stage) builds one batch
of target outputs, turns them into labels with `target_draft_distribution`, and
calls `ttt_loss`, which runs the drafter K times over the batch in one visible
loop and returns the differentiable loss plus per-step metrics
(docs/CONVENTIONS.md §4 and §5). Each step's loss (forward KL unless `TTTConfig.loss`
names another) is computed by eagle3/drafter/losses.py.

Index arithmetic (b = row, t = drafter position, k = step, p = t + 1 + k):

    hidden input   step 0: fc(aux[b, t]);  step k >= 1: step k-1's pre-norm output at t
    embed input    E[input_ids[b, t + 1 + k]]  (teacher forcing from the data, as EAGLE-3)
    rope position  position_ids[b, t] + k      (see Eagle3Drafter.step)
    predicts       token t + 2 + k
    label          target_probs[b, p]: the target's final hidden state at p gives the
                   logits for token p + 1 = t + 2 + k, restricted to the draft rows
    target argmax  target_argmax[b, p]
    carries loss   t + 2 + k < T, loss_mask[b, t + 2 + k] (the predicted token is an
                   assistant token), t2d[target_argmax[b, p]] (the draft vocab can say
                   it), and attention_mask at t and t + 2 + k when one is given;
                   in packed rows also segment_ids[b, t] == segment_ids[b, t + 2 + k]
                   (the predicted token belongs to the same sample)

Rows t with t + 1 + k >= T have no input token; they get a zero embedding and
carry no loss. No valid output ever depends on them: step k at t reads step 0 at
s <= t and steps 1..k at t only. In a packed row the last 1 + k positions of each
sample read the next sample's tokens; they carry no loss either, and attention
never crosses samples, so no valid output depends on them.

`TTTConfig.checkpoint_steps` recomputes each step's activations in backward
(torch.utils.checkpoint) instead of keeping them: less memory, about one more
forward of compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from eagle3.core.errors import PipelineError
from eagle3.drafter.losses import LossSpec, sampling_acceptance, step_loss
from eagle3.drafter.model import Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache


@dataclass
class TTTConfig:
    """How far to unroll, how to weight the steps, and each step's loss."""

    num_steps: int = 7  # K: EAGLE-3 trains 7 draft steps
    step_decay: float = 0.8  # loss weight of step k is step_decay ** k
    checkpoint_steps: bool = False  # recompute each step's activations in backward instead of keeping them
    loss: LossSpec = field(default_factory=LossSpec)  # forward KL unless stage 04's --loss says otherwise

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise PipelineError(
                f"TTTConfig.num_steps = {self.num_steps!r}; it must be an integer >= 1 "
                f"(7 is EAGLE-3's choice; it should be at least the num_speculative_tokens you will serve).")
        if not 0.0 < float(self.step_decay) <= 1.0:
            raise PipelineError(
                f"TTTConfig.step_decay = {self.step_decay!r}; it must be in (0, 1] (EAGLE-3 uses 0.8).")

    def step_weights(self) -> list[float]:
        return [float(self.step_decay) ** k for k in range(self.num_steps)]


@dataclass
class TTTOutput:
    """`loss` is differentiable; `metrics` are plain floats, fetched with one device sync.

    metrics keys: loss_k (the chosen loss), ce_k (its cross-entropy, whatever the loss),
    full_acc_k, cond_acc_k for k in 0..K-1, expected_accept_length (= 1 + sum_k
    full_acc_k), and num_valid (the step-0 valid position count, full_acc's denominator;
    weight by it when averaging batches or ranks). With `target_mass` (held-out batches)
    also the figures under sampling: accept_prob_k (mean acceptance of step k's draft over
    its num_valid_k positions), sample_full_acc_k and sample_accept_length (`ttt_loss`).
    """

    loss: Tensor
    metrics: dict[str, float]


def _at_least_fp32(x: Tensor) -> Tensor:
    """Upcast bf16/fp16 for softmax and loss; leave fp32/fp64 alone (tests run in fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _shift_left(x: Tensor, n: int) -> Tensor:
    """Along dim 1, row t of the result is row t + n of x; the last n rows are zero/False."""
    T = x.shape[1]
    n = min(n, T)
    pad = x.new_zeros((x.shape[0], n) + tuple(x.shape[2:]))
    return torch.cat([x[:, n:], pad], dim=1)  # [B, T - n, ...] + [B, n, ...] -> [B, T, ...]


@torch.no_grad()
def target_draft_distribution(draft_ids: Tensor, *, target_hidden: Tensor, lm_head_weight: Tensor,
                              chunk_size: int = 256) -> Tensor:
    """The target's distribution over the draft vocab: row p is its prediction of token p + 1.

    draft_ids [V_d]: the rows of `lm_head_weight` [V, H] that are the draft vocab (stage 04
    passes the draft rows themselves, V = V_d, and `arange(V_d)`). `target_hidden [B, T, H]`
    is the target's state after its final norm, i.e. what its lm_head reads. The full-vocab
    argmax is not made here: stage 02 stored it (eagle3/target/head.py `argmax`), so only
    the V_d draft rows are multiplied, `chunk_size` positions at a time.
    Returns probs [B, T, V_d] (float32, or float64 for float64 inputs).
    """
    # stage 04 checks the store's hidden size against the target whose lm_head rows it reads
    assert target_hidden.shape[-1] == lm_head_weight.shape[-1], (
        f"hidden width {target_hidden.shape[-1]} does not match the lm_head {tuple(lm_head_weight.shape)}")
    B, T = target_hidden.shape[:2]
    acc = torch.promote_types(lm_head_weight.dtype, torch.float32)
    probs = target_hidden.new_empty((B, T, len(draft_ids)), dtype=acc)  # filled chunk by chunk (no cat copy)
    w_draft = lm_head_weight[draft_ids]  # [V, H] -> [V_d, H]
    for s in range(0, T, chunk_size):
        h = target_hidden[:, s:s + chunk_size].to(lm_head_weight.dtype)  # [B, c, H]
        draft_logits = h @ w_draft.T  # [B, c, H] -> [B, c, V_d]
        probs[:, s:s + chunk_size] = torch.softmax(_at_least_fp32(draft_logits), dim=-1)
    return probs


@dataclass
class StepInputs:
    """What every draft step reads besides its hidden input and the cache (no gradient flows into these)."""

    drafter: Eagle3Drafter
    embeds: Tensor  # [B, T, H]: the frozen target embedding of each input token
    target_probs: Tensor  # [B, T, V_d]: row p is the target's distribution for token p + 1
    loss: LossSpec
    target_mass: Tensor | None  # [B, T]: the draft rows' share of row p's full-vocab mass (held-out only)
    attention_mask: Tensor | None
    position_ids: Tensor | None
    segment_ids: Tensor | None


def check_batch(drafter: Eagle3Drafter, aux: Tensor, input_ids: Tensor, embed_weight: Tensor, target_probs: Tensor,
                target_argmax: Tensor, loss_mask: Tensor) -> None:
    """The batch's tensors agree with each other and with the drafter (a caller's bug otherwise)."""
    B, T = input_ids.shape
    c = drafter.config
    assert aux.shape[:2] == (B, T) and target_argmax.shape == (B, T) and loss_mask.shape == (B, T), (
        f"batch shapes disagree: input_ids {tuple(input_ids.shape)}, aux {tuple(aux.shape)}, "
        f"target_argmax {tuple(target_argmax.shape)}, loss_mask {tuple(loss_mask.shape)}")
    assert target_probs.shape == (B, T, c.draft_vocab_size), (
        f"target_probs {tuple(target_probs.shape)} should be [B, T, V_d] = [{B}, {T}, {c.draft_vocab_size}]: "
        f"build it with target_draft_distribution(drafter.draft_ids(), ...)")
    assert embed_weight.shape == (c.target_vocab_size, c.hidden_size), (
        f"embed_weight {tuple(embed_weight.shape)} is not the [{c.target_vocab_size}, {c.hidden_size}] target "
        f"embedding the drafter config describes")


def valid_positions(k: int, in_draft: Tensor, learn: Tensor, real: Tensor, segment_ids: Tensor | None) -> Tensor:
    """[B, T] bool: position t carries step k's loss (the index arithmetic of the module docstring)."""
    # label row p = t+1+k exists and its argmax is in the draft vocab; token t+2+k is learnable; t is real
    valid = _shift_left(in_draft, 1 + k) & _shift_left(learn, 2 + k) & real  # [B, T]
    if segment_ids is not None:  # and token t+2+k is of the same packed sample as t
        valid &= _shift_left(segment_ids, 2 + k) == segment_ids
    return valid


def draft_step(x: StepInputs, k: int, b_idx: Tensor, t_idx: Tensor, hidden: Tensor, *kv: Tensor):
    """Draft step k and its loss over the N valid positions (b_idx, t_idx).

    Returns (pre-norm output [B, T, H], this step's key and value, the loss (mean over the
    N positions, eagle3/drafter/losses.py), the mean cross-entropy (detached), draft argmax
    [N], acceptance under sampling [N] (empty without `x.target_mass`)).
    Functional in the cache (a fresh TTTCache over the given tensors), so that a
    checkpointed step recomputed in backward appends nothing to the real one; the
    logits live inside it too, so checkpointing also drops their [N, V_d] blocks.
    """
    n = len(kv) // 2
    cache = TTTCache(keys=list(kv[:n]), values=list(kv[n:]))
    embeds = _shift_left(x.embeds, 1 + k)  # [B, T, H]: row t holds token t+1+k
    out = x.drafter.step(embeds, hidden, cache, attention_mask=x.attention_mask, position_ids=x.position_ids,
                         segment_ids=x.segment_ids)  # 2 x [B, T, H] -> [B, T, H]
    logits = x.drafter.compute_logits(out[b_idx, t_idx])  # [N, H] -> [N, V_d], bf16 under autocast
    B, T, V = x.target_probs.shape
    label_rows = b_idx * T + t_idx + 1 + k  # row p = t+1+k of sample b in the flattened [B*T, V_d] targets
    table = x.target_probs.view(B * T, V)
    loss, ce, pred = step_loss(x.loss, logits, table, label_rows)  # means over the N positions
    accept = logits.new_zeros(0)
    if x.target_mass is not None:
        accept = sampling_acceptance(logits.detach(), table, label_rows, x.target_mass.view(B * T)[label_rows])  # [N]
    return out, cache.keys[-1], cache.values[-1], loss, ce, pred, accept


@dataclass
class SamplingSums:
    """Per step, on the device: sum of the acceptance over the step's valid positions, their
    count, and the sum over step-0 positions of the chained product (see `ttt_loss`)."""

    accept: list[Tensor] = field(default_factory=list)
    valid: list[Tensor] = field(default_factory=list)
    chained: list[Tensor] = field(default_factory=list)


def step_metrics(step_losses: list[Tensor], step_ce: list[Tensor], chain_counts: list[Tensor], n_valid0: Tensor,
                 sampling: SamplingSums | None = None) -> dict[str, float]:
    """The metrics dict of `TTTOutput` from per-step sums (see `ttt_loss`)."""
    K = len(step_losses)
    extra = (sampling.accept + sampling.valid + sampling.chained) if sampling else []
    # One device-to-host transfer for all of them (the nonzero in the loop already syncs once per step).
    vals = torch.stack([v.double() for v in step_losses + step_ce + chain_counts + [n_valid0] + extra]).tolist()
    losses, ces, chains, n0 = vals[:K], vals[K:2 * K], vals[2 * K:3 * K], vals[3 * K]
    metrics: dict[str, float] = {}
    for k in range(K):
        metrics[f"loss_{k}"] = losses[k]
        metrics[f"ce_{k}"] = ces[k]
        metrics[f"full_acc_{k}"] = chains[k] / n0 if n0 > 0 else 0.0
        prev = n0 if k == 0 else chains[k - 1]
        metrics[f"cond_acc_{k}"] = chains[k] / prev if prev > 0 else 0.0
    metrics["expected_accept_length"] = 1.0 + sum(metrics[f"full_acc_{k}"] for k in range(K))
    metrics["num_valid"] = n0
    if sampling:
        accept, valid, chained = vals[3 * K + 1:4 * K + 1], vals[4 * K + 1:5 * K + 1], vals[5 * K + 1:]
        for k in range(K):
            metrics[f"accept_prob_{k}"] = accept[k] / valid[k] if valid[k] > 0 else 0.0
            metrics[f"num_valid_{k}"] = valid[k]
            metrics[f"sample_full_acc_{k}"] = chained[k] / n0 if n0 > 0 else 0.0
        metrics["sample_accept_length"] = 1.0 + sum(metrics[f"sample_full_acc_{k}"] for k in range(K))
    return metrics


def ttt_loss(
    drafter: Eagle3Drafter,
    aux: Tensor,
    input_ids: Tensor,
    embed_weight: Tensor,
    target_probs: Tensor,
    target_argmax: Tensor,
    loss_mask: Tensor,
    config: TTTConfig,
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    segment_ids: Tensor | None = None,
    target_mass: Tensor | None = None,
) -> TTTOutput:
    """Unroll the drafter K steps over one batch; loss = sum_k decay^k * loss_k, loss_k the
    mean over step k's valid positions of `config.loss` (eagle3/drafter/losses.py).

    aux [B, T, A*H_t]: fused aux hidden states of the target at each position.
    input_ids [B, T]: target token ids. embed_weight [V_t, H]: the frozen target
    embedding. target_probs [B, T, V_d] and target_argmax [B, T]: row p is the
    target's prediction of token p + 1 (`target_draft_distribution`).
    loss_mask [B, T]: 1 where token j is an assistant token; the prediction of
    token j is trained only if loss_mask[j]. attention_mask [B, T]: 1 = real token.
    segment_ids [B, T] (packed rows): the sample each token belongs to; pass
    position_ids restarting at 0 per sample with it.
    See the module docstring for the index arithmetic.

    Metrics: a step-k output at t *matches* when it carries loss (valid_k) and the
    draft argmax mapped through d2t equals the target's full-vocab argmax. chain_k
    = steps 0..k all match. full_acc_k = #chain_k / #valid_0: the denominator is
    step 0's valid positions for every k, so a later step without a label (past
    the sequence end, outside the assistant mask, argmax outside the draft vocab)
    counts as a miss. That is conservative, makes full_acc non-increasing in k,
    and gives full_acc_k = full_acc_{k-1} * cond_acc_k with cond_acc_k =
    #chain_k / #chain_{k-1} (cond_acc_0 = full_acc_0; 0 when nothing is left).

    Under sampling (`target_mass` [B, T] given: the draft rows' share of the target's
    full-vocabulary probability at each row, held-out batches): alpha_k(t) =
    sum_i min(m p_i, q_i) is the probability that speculative sampling accepts step k's
    draft at t (eagle3/drafter/losses.py `sampling_acceptance`), 0 where step k has no
    label. accept_prob_k = mean of alpha_k over step k's valid positions;
    sample_full_acc_k = sum_t prod_{j<=k} alpha_j(t) / #valid_0, the chance that drafts
    0..k are all accepted (teacher-forced, as full_acc), and sample_accept_length =
    1 + sum_k sample_full_acc_k, the expected tokens per verification step.
    """
    check_batch(drafter, aux, input_ids, embed_weight, target_probs, target_argmax, loss_mask)
    weights = config.step_weights()
    draft_ids = drafter.draft_ids()  # [V_d] target id of each draft row
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    learn = loss_mask.bool() & real  # [B, T]: token j may be trained as a prediction
    in_draft = drafter.t2d[target_argmax]  # [B, T] -> [B, T]: the draft vocab can say row p's argmax
    x = StepInputs(drafter, F.embedding(input_ids, embed_weight), target_probs,  # [B, T] -> [B, T, H]
                   config.loss, target_mass, attention_mask, position_ids, segment_ids)
    hidden = drafter.project_aux(aux)  # [B, T, A*H_t] -> [B, T, H]
    cache = TTTCache()

    total = _at_least_fp32(hidden.new_zeros(()))
    step_losses: list[Tensor] = []
    step_ce: list[Tensor] = []
    chain_counts: list[Tensor] = []
    sampling = SamplingSums() if target_mass is not None else None
    for k in range(config.num_steps):
        valid = valid_positions(k, in_draft, learn, real, segment_ids)  # [B, T]
        b_idx, t_idx = valid.nonzero(as_tuple=True)  # N valid positions
        args = (x, k, b_idx, t_idx, hidden, *cache.keys, *cache.values)
        if config.checkpoint_steps and torch.is_grad_enabled():
            out, key, value, loss_k, ce_k, pred, accept = checkpoint(draft_step, *args, use_reentrant=False)
        else:
            out, key, value, loss_k, ce_k, pred, accept = draft_step(*args)
        cache.keys.append(key)
        cache.values.append(value)
        total = total + weights[k] * loss_k
        step_losses.append(loss_k.detach())
        step_ce.append(ce_k)

        with torch.no_grad():
            hit = draft_ids[pred] == target_argmax[b_idx, t_idx + 1 + k]  # [N] target ids compared
            match = torch.zeros_like(valid)
            match[b_idx, t_idx] = hit  # [B, T]; False wherever step k has no label
            chain = match if k == 0 else chain & match  # steps 0..k all matched
            chain_counts.append(chain.sum())
            if k == 0:
                n_valid0 = valid.sum()  # full_acc's denominator for every k
            if sampling is not None:
                alpha = torch.zeros(valid.shape, dtype=accept.dtype, device=accept.device)
                alpha[b_idx, t_idx] = accept  # [B, T]; 0 wherever step k has no label
                chained = alpha if k == 0 else chained * alpha  # drafts 0..k all accepted
                sampling.accept.append(accept.sum())
                sampling.valid.append(valid.sum())
                sampling.chained.append(chained.sum())
        hidden = out  # the pre-norm output is the next step's hidden input (gradient flows through)
    return TTTOutput(loss=total, metrics=step_metrics(step_losses, step_ce, chain_counts, n_valid0, sampling))


class TTTModel(nn.Module):
    """`ttt_loss` as one module forward, for DDP/FSDP wrapping.

    DDP and FSDP act in a module's forward hooks; `ttt_loss` calls the drafter's
    `step`/`compute_logits` directly (K times), so wrap this module, not the
    drafter, and call it once per batch. The frozen embedding stays an input, not a
    buffer: DDP would otherwise broadcast the [V_t, H] table on every forward.
    """

    def __init__(self, drafter: Eagle3Drafter, config: TTTConfig) -> None:
        super().__init__()
        self.drafter = drafter
        self.config = config

    def forward(self, aux: Tensor, input_ids: Tensor, embed_weight: Tensor, target_probs: Tensor,
                target_argmax: Tensor, loss_mask: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, segment_ids: Tensor | None = None,
                target_mass: Tensor | None = None) -> TTTOutput:
        return ttt_loss(self.drafter, aux, input_ids, embed_weight, target_probs, target_argmax, loss_mask,
                        self.config, attention_mask=attention_mask, position_ids=position_ids,
                        segment_ids=segment_ids, target_mass=target_mass)

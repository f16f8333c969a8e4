"""SpecForge 0.2.0's own EAGLE-3 training step on our stage-02 store (bench only).

Everything bench/bench_quality.py needs from SpecForge, and nothing of SpecForge's code
copied: its modules are imported from a private install (`ensure_specforge`), because
its pins (torch 2.11, transformers 5.8, sglang 0.5.14) fight ours. Read in its source
(specforge 0.2.0 wheel):

- drafter: `specforge/modeling/draft/llama3_eagle.py` `LlamaForCausalLMEagle3`, built by
  `modeling/auto.py` `AutoDraftModel.from_config` as `algorithms/model_providers.py`
  `build_eagle3_draft` does (target embedding loaded and frozen, d2t/t2d buffers set);
  its tensor names are ours (docs/CONVENTIONS.md §6) plus `embed_tokens.weight`.
- TTT forward and loss: `algorithms/eagle3/model.py` `OnlineEagle3Model` (K steps; step
  k at RoPE position t + k; KL to the teacher, mean over all B*T rows), driven by
  `training/strategies/base.py` `Eagle3TrainStrategy` (step weights 0.8^k) with the
  offline compact teacher (`core/compact_teacher.py`: softmax of the draft rows of
  `TargetHead(final)`, full-vocab logsumexp and argmax streamed over the vocabulary).
  `TargetHead.preprocess` shifts input_ids and the final state left by one; the loss
  mask is not shifted, so SpecForge trains position t when token t is an assistant token
  (we train it when token t + 2 is: the same spans, two tokens apart at their edges).
- data: `algorithms/eagle3/data.py` `normalize_offline_sample` (crop, last mask bit 0)
  and `data/utils.py` `DataCollatorWithPadding` (samples right-padded to the longest).
- step and optimizer: `training/controller.py` `TrainerCore.train_step` (forward_loss,
  backward, optimizer boundary) over `training/backend.py` `FSDPTrainingBackend`
  unwrapped (one process), `optimizer.py` `BF16Optimizer` (AdamW on fp32 masters,
  betas (0.9, 0.999), weight decay 0, global-norm clip 0.5) with `lr_scheduler.py`
  `CosineAnnealingWarmupLR` (linear warmup, cosine to 0).

One substitution, forced by the CPU: `core/loss.py` `LogSoftmaxLoss` is a Triton (GPU)
kernel; `_compute_loss` in the same file is SpecForge's reference implementation of the
same loss (forward: -sum(mask * p * log_softmax(z)) per row, mean over B*T rows; the
kernel's backward is that expression's gradient), and runs here in its place. No
package had to be stood in for: the modules imported here need none of the packages
SpecForge pins that are missing (sglang, yunchang, wandb, flash_attn); what they do
import (transformers, datasets, accelerate, safetensors, triton: imported, never
launched) is installed with our stack.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SPECFORGE_VERSION = "0.2.0"
EMBED = "embed_tokens.weight"  # SpecForge's drafter holds the target embedding; the export format has none
CHECK_TOLERANCE = 1e-3  # see check_conversion
LOSS_SUBSTITUTION = ("SpecForge's Triton loss kernel (specforge/core/loss.py LogSoftmaxLoss, GPU only) runs as "
                     "its reference implementation _compute_loss from the same file (same loss and gradient); "
                     "no stand-in modules")


def ensure_specforge(env_dir: Path) -> str:
    """Put SpecForge on sys.path, installing it into `env_dir` first when missing; its version."""
    marker = env_dir / "specforge" / "__init__.py"
    if not marker.is_file():
        print(f"SpecForge {SPECFORGE_VERSION} is not installed in {env_dir}: installing it there with "
              f"`pip install --no-deps --target` (its pins would replace our torch and transformers; the bench "
              f"imports only modules whose imports are installed here)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(env_dir),
               f"specforge=={SPECFORGE_VERSION}"]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"could not install SpecForge: `{' '.join(cmd)}` failed; run it by hand, or pass "
                             f"--specforge-env DIR pointing at a folder holding the specforge package.")
    if str(env_dir) not in sys.path:
        sys.path.insert(0, str(env_dir))
    # Its drafter module warns at import that flash_attn is missing; the sdpa backend used here needs none.
    warnings.filterwarnings("ignore", message="flash_attn is not found")
    from importlib.metadata import PathDistribution

    dist_info = next(env_dir.glob("specforge-*.dist-info"), None)
    return PathDistribution(dist_info).version if dist_info else "unknown"


def use_reference_loss() -> None:
    """Run SpecForge's TTT loss through its own reference implementation (the kernel needs a GPU)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss as sf_loss

    class ReferenceLogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return sf_loss._compute_loss(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = ReferenceLogSoftmaxLoss


def hf_draft_config(drafter_config):
    """SpecForge's draft config (a LlamaConfig naming its EAGLE-3 class) of our drafter's shape."""
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, hidden_act="silu",
                       hidden_size=drafter_config.hidden_size, num_attention_heads=drafter_config.num_attention_heads,
                       num_key_value_heads=drafter_config.num_key_value_heads, head_dim=drafter_config.head_dim,
                       intermediate_size=drafter_config.intermediate_size, vocab_size=drafter_config.target_vocab_size,
                       draft_vocab_size=drafter_config.draft_vocab_size, target_hidden_size=drafter_config.target_hidden_size,
                       max_position_embeddings=drafter_config.max_position_embeddings, rms_norm_eps=drafter_config.rms_norm_eps,
                       rope_theta=drafter_config.rope_theta, rope_scaling=drafter_config.rope_scaling, tie_word_embeddings=False)


PRECISIONS = {
    # name: (parameter dtype, bf16 autocast around each step)
    "autocast": (torch.float32, True),  # what our stage 04 does on CPUs with bf16 matmuls (and on GPUs)
    "fp32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),  # SpecForge's default model.torch_dtype: bf16 weights, fp32 masters
}


@dataclass
class SpecForgeSettings:
    target_model: str  # folder whose embedding (model.embed_tokens.weight) and lm_head SpecForge reads
    ttt_steps: int
    learning_rate: float
    warmup_steps: int
    total_steps: int
    max_seq_len: int
    precision: str  # a key of PRECISIONS
    seed: int
    max_grad_norm: float = 0.5  # SpecForge's default (config/schema.py TrainingConfig)


class SpecForgeTrainer:
    """SpecForge's drafter, TTT model, strategy, backend and optimizer, built as its
    `build_eagle3_draft` / `build_eagle3_model` / `TrainerCore` do, for one process on CPU."""

    def __init__(self, s: SpecForgeSettings, drafter_config, d2t: torch.Tensor, t2d: torch.Tensor, lm_head: torch.Tensor,
                 accumulation_steps: int = 1):
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
        from specforge.training.controller import TrainerCore
        from specforge.training.strategies.base import Eagle3TrainStrategy

        use_reference_loss()
        self.s = s
        self.dtype, self.autocast = PRECISIONS[s.precision]
        torch.manual_seed(s.seed)  # SpecForge's own initialisation (transformers' normal, std 0.02), seeded
        draft = AutoDraftModel.from_config(hf_draft_config(drafter_config), attention_backend="sdpa", torch_dtype=torch.float32)
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
        draft.load_embedding(s.target_model, embedding_key="model.embed_tokens.weight")
        draft.freeze_embedding()
        self.draft = draft.to(dtype=self.dtype)
        self.model = OnlineEagle3Model(self.draft, length=s.ttt_steps, attention_backend="sdpa").to(dtype=self.dtype)
        # TargetHead.from_pretrained wants an index.json and an lm_head tensor; a tied target
        # (SmolLM2) has neither, so the rows come from our loader, then its own freeze, eval, bf16.
        head = TargetHead(s.target_model)
        with torch.no_grad():
            head.fc.weight.copy_(lm_head)
        head.freeze_weights()
        self.head = head.eval().to(dtype=torch.bfloat16)
        self.strategy = Eagle3TrainStrategy(self.model, target_head=self.head, compact_teacher=True)
        # int(warmup_ratio * total) is the warmup SpecForge takes: a ratio a half step above
        # warmup / total gives exactly warmup_steps whatever the float rounding.
        ratio = (s.warmup_steps + 0.5) / s.total_steps
        self.backend = FSDPTrainingBackend(ParallelConfig(world_size=1), optimizer_factory=lambda m: BF16Optimizer(
            m, lr=s.learning_rate, max_grad_norm=s.max_grad_norm, total_steps=s.total_steps, warmup_ratio=ratio))
        self.backend.prepare_model(self.model, wrap=False)
        assert self.backend.optimizer.scheduler.warmup_epochs == s.warmup_steps, self.backend.optimizer.scheduler
        self.core = TrainerCore(self.strategy, self.backend, accumulation_steps=accumulation_steps)

    def batch(self, samples: list, ids: list[str]):
        """SpecForge's offline batch of our store's samples: normalised one by one, then collated."""
        from specforge.algorithms.eagle3.data import normalize_offline_sample
        from specforge.data.utils import DataCollatorWithPadding
        from specforge.runtime.contracts import TrainBatch

        feats = []
        for x in samples:
            raw = {"aux_hidden_state": x.aux[None].to(self.dtype),  # [1, T, A*H] in the fc's dtype
                   "hidden_state": x.final[None],  # [1, T, H] bf16, read by the bf16 TargetHead
                   "input_ids": x.input_ids.long(), "loss_mask": x.loss_mask.long()}
            feats.append(normalize_offline_sample(raw, self.s.max_seq_len))
        return TrainBatch(sample_ids=ids, strategy="eagle3", tensors=DataCollatorWithPadding()(feats),
                          metadata={"target_repr": "hidden_state"})

    def train_step(self, batch) -> dict:
        """One SpecForge optimizer step; its metrics (ploss_k, acc_k, grad_norm, ...) as floats."""
        self.model.train()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else nullcontext()
        with ctx:
            result = self.core.train_step(batch)
        out = {}
        for k, v in result.metrics.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                out[k] = float(v)
            elif isinstance(v, (int, float)):
                out[k] = float(v)
        return out

    def saved_state(self) -> dict[str, torch.Tensor]:
        """The draft weights as SpecForge saves them (its strategy's filter: no frozen embedding)."""
        return {k: v.detach().cpu().clone() for k, v in
                self.strategy.checkpoint_state_filter(self.model.state_dict()).items()}

    def load_saved_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.draft.load_state_dict(state, strict=False)
        assert missing == [EMBED] and not unexpected, (missing, unexpected)

    @torch.no_grad()
    def draft_logits(self, batch) -> list[torch.Tensor]:
        """Every TTT step's draft logits [B, T, V_d] from SpecForge's own forward, in fp32."""
        self.model.float().eval()
        seen: list[torch.Tensor] = []
        original = self.draft.compute_logits

        def recording(hidden):
            logits = original(hidden)
            seen.append(logits.float())
            return logits

        self.draft.compute_logits = recording
        try:
            batch.tensors["hidden_state"] = batch.tensors["hidden_state"].float()
            self.strategy.forward_loss(batch)
        finally:
            del self.draft.compute_logits  # back to the class's method
        return seen


def to_export_state(sf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SpecForge's saved draft weights -> our export format's state dict (docs/CONVENTIONS.md §6).

    The names are already the engines' (fc, midlayer.*, norm, lm_head, d2t, t2d); only the
    frozen target embedding is left out, as both engines take the target's.
    """
    return {k: v.float() if v.is_floating_point() else v for k, v in sf_state.items() if k != EMBED}


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """Along dim 1, row t becomes row t + n; the last n rows are zero."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


@torch.no_grad()
def our_draft_logits(drafter, embed: torch.Tensor, sample, K: int, max_seq_len: int) -> list[torch.Tensor]:
    """Every TTT step's logits [1, T, V_d] of our Eagle3Drafter on one sample, fp32, the
    unroll of eagle3/drafter/ttt.py: step k reads token t + 1 + k and the previous step's output."""
    from eagle3.drafter.ttt_attention import TTTCache

    n = min(sample.num_tokens, max_seq_len)
    ids = sample.input_ids[:n].long()[None]  # [1, T]
    embeds = F.embedding(ids, embed)  # [1, T] -> [1, T, H]
    hidden = drafter.project_aux(sample.aux[:n][None].float())  # [1, T, A*H] -> [1, T, H]
    cache, out = TTTCache(), []
    for k in range(K):
        hidden = drafter.step(_shift_left(embeds, 1 + k), hidden, cache)  # [1, T, H]
        out.append(drafter.compute_logits(hidden).float())  # [1, T, V_d]
    return out


def check_conversion(sf: SpecForgeTrainer, drafter, embed: torch.Tensor, samples: list, ids: list[str],
                     max_seq_len: int) -> dict:
    """The same held-out inputs through SpecForge's model and through our drafter loaded from
    the converted weights, fp32 on both sides: max |logit difference| over every TTT step and
    every position that reads a real token (t + 1 + k < T; beyond it SpecForge embeds token 0
    and we a zero vector, and nothing valid reads those rows).

    Tolerance CHECK_TOLERANCE = 1e-3: the two sides compute the same fp32 function in another
    order (and RoPE frequencies from fp32 vs fp64 powers), which moves logits of a few tens
    by some fp32 ulps of that size per layer, well below 1e-3; a wrong mapping (a swapped
    norm, an aux block out of order, a transposed or mis-shifted input) moves them by far
    more than the bf16 export's own rounding of the weights (2^-9 relative, ~1e-2 on such
    logits). So 1e-3 passes a faithful conversion and fails a broken one.
    """
    K = sf.s.ttt_steps
    theirs = sf.draft_logits(sf.batch(samples, ids))  # K x [B, T_max, V_d]
    worst, scale, rows = 0.0, 0.0, 0
    for b, x in enumerate(samples):
        ours = our_draft_logits(drafter, embed, x, K, max_seq_len)
        n = ours[0].shape[1]
        for k in range(K):
            m = n - 1 - k  # rows t with a real input token t + 1 + k
            if m <= 0:
                continue
            d = (theirs[k][b, :m] - ours[k][0, :m]).abs().max().item()
            worst = max(worst, d)
            scale = max(scale, ours[k][0, :m].abs().max().item())
            rows += m
    return {"max_abs_diff": worst, "max_abs_logit": scale, "rows_compared": rows, "steps": K,
            "samples": len(samples), "tolerance": CHECK_TOLERANCE, "ok": worst <= CHECK_TOLERANCE}

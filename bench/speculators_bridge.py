"""speculators 0.9.0's own EAGLE-3 trainer on our stage-02 store (bench only).

Everything bench/bench_quality.py needs from speculators (vllm-project/speculators, the
0.9.0 wheel), and nothing of its code copied: its modules are imported from a private
install (`ensure_speculators`: `pip install --no-deps --target`, speculators and the
hs-connectors package its data module imports, 2.7 MB in all; a second or two), so its
pins never touch our environment. What the bench takes from it, read in its source:

- drafter: `models/eagle3/core.py` `Eagle3DraftModel`, built by its own
  `Eagle3DraftModel.from_training_args` (what `train/cli.py` `build_draft_model` calls):
  `load_vocab_mappings(t2d, d2t)`, then `load_verifier_weights()` (`model.py`
  `DraftVocabMixin`: the target's embedding, frozen; its lm_head rows of the draft vocab
  as the drafter's lm_head, frozen, and as the teacher head `verifier_lm_head`). Its one
  decoder layer is `models/eagle3/model_definitions.py` `LlamaDecoderEagle3FirstLayer`
  (transformers' LlamaDecoderLayer with q/k/v over cat(embed, hidden) and a `hidden_norm`).
- TTT forward and loss: `Eagle3DraftModel.forward` (K steps; step k at RoPE position
  t + 1 + k, i.e. ours + 1, which RoPE cannot see; the teacher is
  `verifier_lm_head(verifier_norm(final))`), per-step loss and metrics in
  `models/eagle3/metrics.py` `compute_metrics` through `losses/utils.py`
  `compound_loss` / `loss_function` (mean over the masked positions of the row, step k
  weighted ttt_step_loss_decay ** k), the loss chosen by `resolve_loss_config`:
  `kl_div`, `rkl`, `jsd`, `ce`, `tv`, `nla` (-log alpha, the LK paper's LK^alpha, arXiv
  2602.23881) and `lk_hybrid` (lambda KL + (1 - lambda) TV with lambda =
  exp(-3 sg[alpha]), the paper's hybrid), or a JSON dict of weights over them. The bench's
  default is `lk_hybrid`.
- data: `train/data.py` `BaseDataset` (subclassed over our store: its `__getitem__`
  adds lengths and positions), `models/eagle3/data.py` `shift_batch` (aligns hidden t with
  token t + 1, teacher and loss mask at t + 1) and `train/data.py` `CollateFn` (packs a
  step's samples into one row with document ids; attention never crosses samples).
- step, optimizer, schedule: `train/trainer.py` `Trainer.train_epoch` (bf16 autocast
  around the forward, backward, clip 1.0, every optimizer's step, every scheduler's step),
  `train/optimizers.py` `build_optimizers` (its default `muon`: torch.optim.Muon on the
  2-D weights, AdamW on the rest; or `adamw`) and transformers' linear (its default) or
  cosine warmup schedule. Hyperparameters the budget does not fix (weight decays, Muon's
  momentum and steps, step decay, schedule type) are its CLI defaults, read from its
  schema (`train/config/schema.py`).

Not its CLI defaults, so that the weights are ours to serve: the drafter's shape is our
stage 04's (`--draft-config` in its CLI), one full-attention layer (its CLI makes every
layer sliding-window, 2048, by default: no difference for samples of <= 2048 tokens),
and its EAGLE-3 variants off: `norm_before_residual`, `norm_before_fc` and `norm_output`
(Eagle 3.1), on by default for eagle3 in 0.9.0, change the layer into one our export
format (docs/CONVENTIONS.md §6), SGLang and our `Eagle3Drafter` do not have. Teacher
input: our store keeps the target's final state after its final norm (speculators
captures it before), so `verifier_norm` is an identity here.

What had to change for a CPU (all in `SpeculatorsTrainer`, none of its files edited):
- `draft_attn_impl = "sdpa"`: its default flex attention needs a GPU kernel; `sdpa` is
  its own documented choice for such hardware (schema: "Use 'sdpa' or 'eager' for
  hardware that doesn't support flex attention").
- `loss_implementation = "eager"`: its `fused` losses are Triton kernels
  (`losses/fused.py`); `losses/eager.py` is its own reference implementation of the same
  losses, a CLI choice ("for compatibility and numerical validation").
- `Trainer` puts the model on `get_local_rank()` (0, i.e. cuda:0) and autocasts on
  `torch.accelerator.current_accelerator()` or "cuda": here the device is the CPU and
  autocast runs on "cpu" (bf16, or off for `--peer-precision fp32`).
- its step timer (`_StepTimer`) calls `torch.accelerator.synchronize()`, which raises
  without an accelerator: a subclass takes the same times without it. Its rich progress
  bar is left out (the bench prints its own lines); its per-step metrics are read from
  its `speculators.metrics` logger.
"""
from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_bridge import our_draft_logits

SPECULATORS_VERSION = "0.9.0"
PACKAGES = (f"speculators=={SPECULATORS_VERSION}", "hs-connectors==0.9.0")  # hs_connectors: train/data.py imports it
# Modules the speculators files the bench imports import beyond torch, transformers, datasets and
# safetensors (vLLM's install brings them all), with the distribution each is in.
NEEDED_MODULES = (("loguru", "loguru"), ("pydantic", "pydantic"), ("pydantic_settings", "pydantic-settings"),
                  ("openai", "openai"), ("httpx", "httpx"), ("aiohttp", "aiohttp"), ("rich", "rich"),
                  ("yaml", "pyyaml"))
LOSS_IMPLEMENTATION = "eager"  # its Triton kernels ("fused") need a GPU; see the module docstring
ATTN_IMPLEMENTATION = "sdpa"  # its flex attention needs a GPU kernel
DEFAULT_LOSS = "lk_hybrid"
CHECK_TOLERANCE = 1e-3  # as specforge_bridge.CHECK_TOLERANCE, for the same reasons (check_conversion)
LAYER_PREFIX, OUR_LAYER_PREFIX = "layers.0.", "midlayer."
NOT_EXPORTED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
CPU_CHANGES = ("sdpa attention and its eager (reference) losses in place of its flex-attention and Triton kernels; "
               "model and autocast on the CPU; its step timer without the accelerator synchronize")

PRECISIONS = {
    # name: speculators' hidden_states_dtype (its data and autocast dtype; master weights stay fp32)
    "autocast": torch.bfloat16,  # its default, and our stage 04's on CPUs with bf16 matmuls
    "fp32": torch.float32,
}


def ensure_speculators(env_dir: Path) -> str:
    """Put speculators on sys.path, installing it into `env_dir` first when missing; its version."""
    have = all((env_dir / pkg / "__init__.py").is_file() for pkg in ("speculators", "hs_connectors"))
    if not have:
        print(f"speculators {SPECULATORS_VERSION} is not installed in {env_dir}: installing it there with "
              f"`pip install --no-deps --target` (its pins are not ours to take; the bench imports only modules "
              f"whose imports are installed here)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(env_dir), *PACKAGES]
        t0 = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"could not install speculators: `{' '.join(cmd)}` failed; run it by hand, or pass "
                             f"--speculators-env DIR pointing at a folder holding the speculators package.")
        print(f"installed in {time.perf_counter() - t0:.0f} s", flush=True)
    missing = [dist for module, dist in NEEDED_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"speculators' modules import {', '.join(missing)}, not installed here: "
                         f"`{sys.executable} -m pip install --target {env_dir} {' '.join(missing)}` puts them "
                         f"beside it without touching this environment.")
    if str(env_dir) not in sys.path:
        sys.path.insert(0, str(env_dir))
    from importlib.metadata import PathDistribution

    dist_info = next(env_dir.glob("speculators-*.dist-info"), None)
    return PathDistribution(dist_info).version if dist_info else "unknown"


def check_loss(spec: str) -> str:
    """`spec` as speculators parses it (a name or a JSON dict of weights); raises SystemExit if it cannot."""
    from speculators.losses import resolve_loss_config

    try:
        resolve_loss_config(spec, LOSS_IMPLEMENTATION)
    except ValueError as error:
        raise SystemExit(f"--peer-loss {spec!r}: {error}") from None
    return spec


def draft_layer_config(drafter_config):
    """speculators' transformer_layer_config (a LlamaConfig) of our drafter's shape."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, hidden_act="silu", hidden_size=drafter_config.hidden_size,
                       num_attention_heads=drafter_config.num_attention_heads, num_key_value_heads=drafter_config.num_key_value_heads,
                       head_dim=drafter_config.head_dim, intermediate_size=drafter_config.intermediate_size,
                       vocab_size=drafter_config.target_vocab_size, max_position_embeddings=drafter_config.max_position_embeddings,
                       rms_norm_eps=drafter_config.rms_norm_eps, rope_theta=drafter_config.rope_theta, rope_scaling=drafter_config.rope_scaling,
                       attention_bias=False, mlp_bias=False, tie_word_embeddings=False)


def cli_defaults() -> dict:
    """The hyperparameters speculators' CLI would use, from its schema (train/config/schema.py)."""
    from speculators.train.config.schema import LossArgs, OptimizerArgs, SchedulerArgs

    opt, loss, sched = OptimizerArgs(), LossArgs(), SchedulerArgs()
    return {"optimizer": opt.optimizer, "weight_decay": opt.weight_decay, "muon_momentum": opt.muon_momentum,
            "muon_weight_decay": opt.muon_weight_decay, "muon_ns_steps": opt.muon_ns_steps,
            "muon_adjust_lr_fn": opt.muon_adjust_lr_fn, "step_decay": loss.ttt_step_loss_decay,
            "scheduler": sched.scheduler_type}


@dataclass
class SpeculatorsSettings:
    target_model: str  # the verifier folder its loaders read (config, embedding, lm_head)
    aux_layers: list[int]
    ttt_steps: int
    learning_rate: float  # AdamW's lr and Muon's (its muon_lr defaults to lr)
    warmup_steps: int
    total_steps: int
    max_seq_len: int  # samples cropped to this many tokens (its preprocessing truncates to seq_length)
    precision: str  # a key of PRECISIONS
    seed: int
    loss: str = DEFAULT_LOSS
    optimizer: str | None = None  # None: its CLI default (muon)
    scheduler: str | None = None  # None: its CLI default (linear)
    step_decay: float | None = None  # None: its CLI default (1.0)

    def resolved(self) -> dict:
        """Every setting, with its CLI defaults filled in."""
        return {**cli_defaults(), **{k: v for k, v in self.__dict__.items() if v is not None}}


def _store_dataset(split, max_seq_len: int, dtype: torch.dtype):
    """speculators' BaseDataset over our store's split: raw samples in its layout."""
    from speculators.train.data import BaseDataset

    class StoreSamples(BaseDataset):
        def __init__(self):
            self.split, self.crop = split, max_seq_len
            super().__init__(max_seq_len, dtype)

        def __len__(self) -> int:
            return len(self.split)

        def _compute_approx_lengths(self) -> list[int]:
            return [min(n, self.crop) for n in self.split.lengths()]

        def _get_raw_data(self, index: int) -> dict:
            x = self.split[index]
            n = min(x.num_tokens, self.crop)
            return {"hidden_states": x.aux[:n],  # [n, A*H], aux layers in ascending order as its capture
                    "input_ids": x.input_ids[:n].long(),  # [n]
                    "verifier_last_hidden_states": x.final[:n],  # [n, H], after the target's final norm
                    "loss_mask": x.loss_mask[:n].bool()}  # [n]

    return StoreSamples()


class _PlannedSteps:
    """The train loader its Trainer iterates: step s's batch is our plan's step s."""

    batch_sampler = None  # no sampler: no epochs to reshuffle, no resume to skip

    def __init__(self, total: int, batch_of_step):
        self.total, self.batch_of_step = total, batch_of_step

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        return (self.batch_of_step(s) for s in range(self.total))


class _MetricRecords(logging.Handler):
    """Appends the dicts its Trainer logs to `speculators.metrics` (one per step) to `records`."""

    def __init__(self, records: list[dict]):
        super().__init__(logging.INFO)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


class SpeculatorsTrainer:
    """speculators' drafter, TTT forward, losses, optimizers, schedulers and train loop,
    built as its `train/cli.py` `main` builds them, for one process on CPU."""

    def __init__(self, s: SpeculatorsSettings, drafter_config, d2t: torch.Tensor, t2d: torch.Tensor, split,
                 steps: list[list[int]], run_dir: Path):
        """`steps[s]`: the sample indices of `split` that optimizer step s trains on."""
        import speculators.train.trainer as spec_trainer
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn
        from speculators.train.trainer import Trainer, TrainerConfig

        self.s, self.settings = s, s.resolved()
        self.dtype = PRECISIONS[s.precision]
        self.drafter_config = drafter_config
        # Its set_seed, then its own initialisation (transformers' normal, std 0.02).
        torch.manual_seed(s.seed)
        layer_cfg = draft_layer_config(drafter_config)
        # Its loader logs (loguru) every file it opens; the teacher check in bench_quality.py
        # says whether it read the rows ours reads.
        from loguru import logger as loguru_logger

        loguru_logger.disable("speculators.utils.loading")
        try:
            model = Eagle3DraftModel.from_training_args(
                verifier_config=layer_cfg, t2d=t2d.clone(), d2t=d2t.clone(), verifier_name_or_path=s.target_model,
                target_layer_ids=list(s.aux_layers), draft_attn_impl=ATTN_IMPLEMENTATION,
                draft_vocab_size=drafter_config.draft_vocab_size, ttt_steps=s.ttt_steps, norm_before_residual=False,
                norm_before_fc=False, fc_norm=False, norm_output=False, embed_requires_grad=False)
        finally:
            loguru_logger.enable("speculators.utils.loading")
        # Our store's final state is already normed (its capture is not): an identity, not the target's norm again.
        model.verifier_norm = torch.nn.Identity()
        self.model = model
        train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
            loss_fn=s.loss, loss_implementation=LOSS_IMPLEMENTATION, ttt_steps=s.ttt_steps,
            ttt_step_loss_decay=self.settings["step_decay"])
        self.train_kwargs = train_kwargs

        self.dataset = _store_dataset(split, s.max_seq_len, self.dtype)
        self.shift_batch, self.collate_class = shift_batch, CollateFn
        self.steps = steps
        config = TrainerConfig(
            lr=s.learning_rate, num_epochs=1, save_path=str(run_dir), resume_from_checkpoint=False,
            train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs, optimizer=self.settings["optimizer"],
            weight_decay=self.settings["weight_decay"], muon_lr=s.learning_rate,
            muon_momentum=self.settings["muon_momentum"], muon_weight_decay=self.settings["muon_weight_decay"],
            muon_ns_steps=self.settings["muon_ns_steps"], muon_adjust_lr_fn=self.settings["muon_adjust_lr_fn"],
            scheduler_type=self.settings["scheduler"], scheduler_warmup_steps=s.warmup_steps,
            scheduler_total_steps=s.total_steps, hidden_states_dtype=self.dtype, log_freq=1,
            max_steps=s.total_steps)
        # CPU: the model goes to the CPU, not to local rank 0 (cuda:0); see the module docstring.
        local_rank = spec_trainer.get_local_rank
        spec_trainer.get_local_rank = lambda: torch.device("cpu")
        try:
            self.trainer = Trainer(model, config, _PlannedSteps(s.total_steps, self.batch), None)
        finally:
            spec_trainer.get_local_rank = local_rank
        self.trainer.device_type = "cpu"  # its autocast device ("cuda" when no accelerator is found)
        assert [sched.lr_lambdas[0](s.warmup_steps) for sched in self.trainer.schedulers] == \
            [1.0] * len(self.trainer.schedulers), "its schedule does not peak after our warmup"

    # -- data --------------------------------------------------------------------
    def batch(self, step: int) -> dict:
        """Optimizer step `step`'s samples as its collator's one packed row (no padding)."""
        items = [self.dataset[i] for i in self.steps[step]]
        return self.collate(items)

    def collate(self, items: list[dict]) -> dict:
        length = sum(max(int(x["lengths"][0]) - 1, 0) for x in items)  # shift_batch drops one token per sample
        collate = self.collate_class(max_len=length, hidden_size=self.drafter_config.hidden_size,
                                     num_target_layers=len(self.s.aux_layers), dtype=self.dtype,
                                     preprocess=self.shift_batch)
        return collate(items)

    # -- training ----------------------------------------------------------------
    def fit(self, after_step, records: list[dict]) -> None:
        """Its train loop over every planned step. Each step's metric record (its loss, per-step
        loss and accuracies, lr) is appended to `records`, then `after_step(steps_done)` runs
        (its step_callback)."""
        import speculators.train.trainer as spec_trainer

        class CpuStepTimer(spec_trainer._StepTimer):  # the same marks, no accelerator to synchronize
            def mark(self, name: str) -> None:
                if self.enabled:
                    self._marks[name] = time.perf_counter()

            def now(self) -> float | None:
                return time.perf_counter() if self.enabled else None

        handler = _MetricRecords(records)
        metric_log = logging.getLogger("speculators.metrics")
        saved = (spec_trainer._StepTimer, spec_trainer.tqdm, metric_log.level, metric_log.propagate)
        spec_trainer._StepTimer = CpuStepTimer
        spec_trainer.tqdm = lambda iterable, **_: iterable  # the bench prints its own progress lines
        metric_log.setLevel(logging.INFO)
        metric_log.propagate = False
        metric_log.addHandler(handler)
        try:
            with warnings.catch_warnings():
                # fp32: autocast on the CPU with float32 is off, as intended, and says so every step.
                warnings.filterwarnings("ignore", message=".*CPU autocast.*not supported.*")
                self.trainer.train_epoch(0, step_callback=lambda: after_step(self.trainer.global_step))
        finally:
            spec_trainer._StepTimer, spec_trainer.tqdm = saved[0], saved[1]
            metric_log.setLevel(saved[2])
            metric_log.propagate = saved[3]
            metric_log.removeHandler(handler)
        assert self.trainer.global_step == self.s.total_steps, (self.trainer.global_step, self.s.total_steps)

    def learning_rates(self) -> list[float]:
        return [opt.param_groups[0]["lr"] for opt in self.trainer.optimizers]

    # -- weights -----------------------------------------------------------------
    def saved_state(self) -> dict[str, torch.Tensor]:
        """The draft weights as it saves them (no teacher head), less the frozen target embedding."""
        skip = set(self.model._keys_to_ignore_on_save) | {"embed_tokens.weight"}
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k not in skip}

    def load_saved_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert sorted(missing) == ["embed_tokens.weight", "verifier_lm_head.weight"] and not unexpected, \
            (missing, unexpected)

    def teacher_rows(self) -> torch.Tensor:
        """Its teacher head [V_d, H]: the target's lm_head rows its loader picked by t2d."""
        return self.model.verifier_lm_head.weight.detach()

    @torch.no_grad()
    def draft_logits(self, item: dict) -> list[torch.Tensor]:
        """Every TTT step's logits [T - 1, V_d] of one raw sample (`held_out_items`) from its
        own forward, fp32, rows t = 0..T-2 (its shift_batch drops the last hidden state)."""
        self.model.float().eval()
        collate = self.collate_class(max_len=int(item["lengths"][0]) - 1, hidden_size=self.drafter_config.hidden_size,
                                     num_target_layers=len(self.s.aux_layers), dtype=torch.float32,
                                     preprocess=self.shift_batch)
        row = collate([item])
        seen: list[torch.Tensor] = []
        hook = self.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out[0].float()))
        try:  # no teacher states: its forward returns the draft tokens and no loss
            self.model(hidden_states=row["hidden_states"], input_ids=row["input_ids"],
                       document_ids=row["document_ids"], position_ids=row["position_ids"],
                       ttt_steps=self.s.ttt_steps)
        finally:
            hook.remove()
        return seen

    def held_out_items(self, split) -> object:
        """Its dataset over another split of the store (raw samples, fp32 in the collator)."""
        return _store_dataset(split, self.s.max_seq_len, torch.float32)


def to_export_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' saved draft weights -> our export format's state dict (docs/CONVENTIONS.md §6).

    Its one decoder layer is `layers.0.*`, ours (and the engines') `midlayer.*`; fc, norm,
    lm_head, d2t and t2d keep their names; the target's embedding and the teacher head are
    not the drafter's.
    """
    out = {}
    for name, tensor in state.items():
        if name in NOT_EXPORTED:
            continue
        if name.startswith("layers.") and not name.startswith(LAYER_PREFIX):
            raise SystemExit(f"speculators' drafter has a second decoder layer ({name}); the export format has one")
        ours = OUR_LAYER_PREFIX + name[len(LAYER_PREFIX):] if name.startswith(LAYER_PREFIX) else name
        out[ours] = tensor.float() if tensor.is_floating_point() else tensor
    return out


def check_conversion(peer: SpeculatorsTrainer, drafter, embed: torch.Tensor, split, indices: list[int],
                     max_seq_len: int) -> dict:
    """The same held-out samples through speculators' model and through our drafter loaded from
    the converted weights, fp32 on both sides: max |logit difference| over every TTT step and
    every position that reads a real token (t + 1 + k < T). Tolerance CHECK_TOLERANCE, as
    specforge_bridge.check_conversion argues: the same fp32 function in another order moves
    logits by fp32 ulps; a wrong mapping moves them by far more than the bf16 export's rounding.
    """
    K = peer.s.ttt_steps
    items = peer.held_out_items(split)
    worst, scale, rows = 0.0, 0.0, 0
    for i in indices:
        x = split[i]
        theirs = peer.draft_logits(items[i])  # K x [T - 1, V_d]
        ours = our_draft_logits(drafter, embed, x, K, max_seq_len)  # K x [1, T, V_d]
        n = ours[0].shape[1]
        for k in range(K):
            m = n - 1 - k  # rows t with a real input token t + 1 + k
            if m <= 0:
                continue
            diff = (theirs[k][:m] - ours[k][0, :m]).abs().max().item()
            worst = max(worst, diff)
            scale = max(scale, ours[k][0, :m].abs().max().item())
            rows += m
    return {"max_abs_diff": worst, "max_abs_logit": scale, "rows_compared": rows, "steps": K,
            "samples": len(indices), "tolerance": CHECK_TOLERANCE, "ok": worst <= CHECK_TOLERANCE}


def settings_text(settings: dict) -> str:
    """One line: the recipe speculators trained with."""
    opt = settings["optimizer"]
    opt_text = (f"Muon (momentum {settings['muon_momentum']:g}, weight decay {settings['muon_weight_decay']:g}, "
                f"{settings['muon_adjust_lr_fn']}) on 2-D weights + AdamW (weight decay {settings['weight_decay']:g})"
                if opt == "muon" else f"AdamW (betas (0.9, 0.999), weight decay {settings['weight_decay']:g})")
    decay = settings["step_decay"]
    weights = "every TTT step weighted 1" if decay == 1 else f"TTT step k weighted {decay:g}^k"
    return f"loss {settings['loss']}, {weights}, {opt_text}, {settings['scheduler']} schedule to 0, clip 1.0"


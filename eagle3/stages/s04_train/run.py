"""Stage 04: train the drafter with train-time-test unrolling; resumable; DDP.

Reads stage 02's store (aux states, the target's normed final state and argmax),
stage 03's mapping, and the target's embedding and draft-vocab lm_head rows
(from its safetensors, never the whole model). Writes (names from eagle3/artifacts/workdir.py):

    04_train/checkpoints/       one file per saved step, the best one, a pointer to the latest
    04_train/metrics.jsonl      one JSON line per log interval and evaluation (eagle3/stages/s04_train/metrics.py)
    04_train/tensorboard/       when tensorboard is installed
    04_train/manifest.json      best held-out expected accept length and its checkpoint

Run: `python 04_train_drafter.py --config configs/tiny-llama.yaml`, or on 8 GPUs
`torchrun --nproc-per-node 8 04_train_drafter.py --config configs/kimi-k2.5.yaml`.

The train data is one `DataSource` (eagle3/stages/s04_train/data_source.py): the store's
whole train split, or, over windows of the store (stage 02's --disk-budget), the split
round by round (eagle3/stages/s04_train/windows.py, which also deletes each round after the
checkpoint that covers it); the schedule, optimizer and step counter span all rounds.
`Trainer` never asks which.

Reading order: `train_drafter` (the stage) -> `read_inputs` (checked inputs and the
run's identity) -> `Trainer`: `__init__` builds the drafter, the frozen target
weights, the data source, the optimizer and the schedule; `train_step` is one optimizer
step; `evaluate` the held-out metrics; `state_dict`/`load_state_dict` what a checkpoint
holds; `fit` the loop; `finish` the manifest.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.artifacts import claims
from eagle3.artifacts.manifest import (Manifest, already_complete, manifest_fingerprint, read_manifest, read_record,
                                       sha256_file, sha256_json, write_manifest)
from eagle3.artifacts.records import TrainRecord
from eagle3.artifacts.store import STORE_JSON, HiddenStateStore
from eagle3.artifacts.train_outputs import TrainCheckpoint
from eagle3.artifacts.vocab_map import load_mapping, target_ids
from eagle3.artifacts.windows import PROGRESS_JSON, read_plan, windows_dir
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.drafter.cpu import bf16_fused_attention_ok, bf16_pays
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.shape import drafter_config_for_target
from eagle3.drafter.ttt import TTTConfig, TTTModel, target_draft_distribution
from eagle3.serving.engine_rules import target_family
from eagle3.stages.s04_train.checkpoint import (latest_checkpoint, rng_states_of_all_ranks, save_checkpoint,
                                                set_rng_state)
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.cuda_alloc import configure_cuda_allocator
from eagle3.stages.s04_train.data import Batching, load_batch, noisy_aux, to_device
from eagle3.stages.s04_train.data_source import open_data_source
from eagle3.stages.s04_train.distributed import Dist, barrier, close_distributed, init_distributed, wrap_ddp
from eagle3.stages.s04_train.evaluation import evaluate_held_out
from eagle3.stages.s04_train.finetune import InitReport, load_initial_drafter
from eagle3.stages.s04_train.memory import GIB, predict_peak
from eagle3.stages.s04_train.metrics import MetricsLog, MetricSum, fmt
from eagle3.stages.s04_train.summary import all_settings, end_of_run_lines, run_config
from eagle3.stages.s04_train.target_mass import HeldOutMass
from eagle3.stages.s04_train.target_layer_init import init_from_target_layer, init_head_from_target
from eagle3.target.head import load_embedding, load_lm_head
from eagle3.target.info import TargetInfo, read_target_info, validate_aux_layers

log = logging.getLogger(__name__)


# -- setup -------------------------------------------------------------------------
# The process group and every collective outside DDP: eagle3/stages/s04_train/distributed.py.
def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError("--device cuda, but torch sees no GPU; use --device cpu or install a CUDA torch.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(choice)


def warmup_plan(warmup_steps: int, warmup_ratio: float | None, total: int) -> tuple[int, str | None]:
    """The warmup steps of a run of `total` steps, and a warning when they pass a third of it
    (published EAGLE-3 recipes warm up for 1.5-20% of the run: docs/KIMI_K25.md)."""
    warmup = round(warmup_ratio * total) if warmup_ratio is not None else warmup_steps
    warmup = min(warmup, total)
    if total > 0 and warmup > total / 3:
        how = f"warmup_ratio = {warmup_ratio}" if warmup_ratio is not None else f"warmup_steps = {warmup_steps}"
        return warmup, (f"{how} warms up for {warmup} of the {total} planned steps ({100 * warmup / total:.0f}%, "
                        f"more than a third): the learning rate peaks late and decays over what is left; "
                        f"published recipes warm up for 1.5-20% of the run: set warmup_ratio, e.g. 0.05")
    return warmup, None


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def optimizer_and_schedule(params: list[torch.nn.Parameter], cfg: TrainConfig, total: int,
                           main: bool) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its warmup-then-cosine schedule over the run's `total` steps."""
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    warmup, warning = warmup_plan(cfg.warmup_steps, cfg.warmup_ratio, total)
    if warning and main:
        log.warning("%s", warning)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, cfg.min_lr_ratio))


def move_schedule(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Go on at `step` of this run's schedule (a resume under another process count): the
    learning rate is the schedule's at `step`, as if the run had taken this count's steps."""
    sched.last_epoch = step  # LambdaLR: after s steps, last_epoch is s and lr = base * f(s)
    lrs = [base * f(step) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs  # what get_last_lr() reports until the next step


def bf16_autocast_pays(device: torch.device) -> bool:
    """`precision: auto`: bf16 autocast on GPU, and on CPUs with bf16 matmuls in hardware
    (eagle3/drafter/cpu.py); elsewhere fp32, where emulated bf16 is slower than fp32."""
    return device.type == "cuda" or bf16_pays()


def log_memory_prediction(cfg: TrainConfig, drafter_config: DrafterConfig, device: torch.device, dist: Dist) -> None:
    """Log eagle3/stages/s04_train/memory.py's predicted peak per process (bf16 autocast, as on GPUs);
    warn when it exceeds 85% of this GPU."""
    # The reference attention's score blocks span a whole row: a packed row is batch_tokens long.
    row = cfg.batch_tokens if (cfg.packing and cfg.attention == "reference") else cfg.max_seq_len
    est = predict_peak(drafter_config, ttt_steps=cfg.ttt_steps, batch_tokens=cfg.batch_tokens, row_len=row,
                       attention=cfg.attention, checkpoint_steps=cfg.checkpoint_steps, ddp=dist.world > 1,
                       fp32_attention=device.type == "cpu" and not bf16_fused_attention_ok())
    log.info("predicted peak memory per process under bf16 autocast (--batch-tokens %d, --max-seq-len %d, "
             "--attention %s, --checkpoint-steps %s): %s", cfg.batch_tokens, cfg.max_seq_len, cfg.attention,
             cfg.checkpoint_steps, est.summary())
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if est.total > 0.85 * total:
            log.warning("the prediction (%.1f GiB) exceeds 85%% of this GPU's %.1f GiB: expect an out-of-memory "
                        "error; lower --batch-tokens (raise --grad-accum to keep the step size) or pass "
                        "--checkpoint-steps", est.total / GIB, total / GIB)


# -- inputs ------------------------------------------------------------------------
@dataclass
class StageInputs:
    """What stage 04 reads, checked against each other, and the run's identity."""

    info: TargetInfo
    store: HiddenStateStore
    d2t: torch.Tensor  # [V_d] int64, stage 03 (docs/CONVENTIONS.md §2)
    t2d: torch.Tensor  # [V_t] bool
    params: dict  # the config's identity fields
    inputs: dict  # fingerprints of the upstream manifests (and of --init-from's files)

    @property
    def identity(self) -> str:
        """A checkpoint resumes only a run of the same identity (eagle3/stages/s04_train/checkpoint.py)."""
        return sha256_json({"params": self.params, "inputs": self.inputs})


def read_inputs(cfg: TrainConfig, workdir: WorkDir) -> StageInputs:
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    prep = read_record(workdir, "prepare", needed_by="stage 04 (train)")
    vocab_m = read_manifest(workdir, "vocab", needed_by="stage 04 (train)")
    store = HiddenStateStore.open(workdir, needed_by="stage 04 (train)",
                                  tokenizer_fingerprint=prep.tokenizer_fingerprint,
                                  hidden_size=info.hidden_size,
                                  expected_from={"tokenizer_fingerprint": str(workdir.manifest("prepare")),
                                                 "hidden_size": f"{cfg.target_model}'s config (--target-model)"})
    if store.vocab_size != info.vocab_size:
        raise PipelineError(f"the store was extracted from a target with vocab {store.vocab_size}, "
                            f"{cfg.target_model} has {info.vocab_size}; pass the same --target-model as stage 02.")
    # The aux layer ids, once, before any work: the drafter is built for the store's ids and
    # every checkpoint records them, so stage 05 takes them as checked against the target.
    validate_aux_layers(store.aux_layers, info.num_layers,
                        source=f"the aux layer ids of {store.dir / STORE_JSON} for {cfg.target_model}",
                        fix="pass the same --target-model as stage 02, or rerun stage 02 with --force and ids")
    d2t, t2d = load_mapping(workdir)
    if t2d.shape[0] != info.vocab_size:
        raise PipelineError(f"{workdir.t2d()} covers {t2d.shape[0]} target ids, {cfg.target_model} has "
                            f"{info.vocab_size}; rerun stage 03 for this target.")
    inputs = {"extract": manifest_fingerprint(store.manifest), "vocab": manifest_fingerprint(vocab_m)}
    if cfg.init_from:
        inputs["init_from"] = {p.name: sha256_file(p) for p in sorted(Path(cfg.init_from).iterdir())
                               if p.suffix in (".json", ".safetensors")}
    return StageInputs(info, store, d2t, t2d, identity_params(cfg), inputs)


def build_drafter(cfg: TrainConfig, src: StageInputs) -> tuple[Eagle3Drafter, InitReport | None]:
    """A fresh drafter shaped after the target over stage 03's mapping, or `--init-from`'s."""
    torch.manual_seed(cfg.seed)  # the initial weights are a function of --seed
    if cfg.init_from:
        return drafter_from(cfg, src)
    drafter_config = drafter_config_for_target(src.info, cfg, len(src.d2t))
    drafter_config.num_aux_layers = src.store.num_aux  # what stage 02 captured, whatever the target's default
    drafter = Eagle3Drafter(drafter_config, attention=cfg.attention)
    drafter.set_vocab_mapping(src.d2t, src.t2d)
    if cfg.init_layer is not None:
        layer = init_from_target_layer(drafter, src.info, cfg.init_layer)
        log.info("the drafter's decoder layer starts from target layer %d (--init-layer %d)", layer, cfg.init_layer)
    if cfg.init_head:
        init_head_from_target(drafter, src.info, src.store.aux_layers)
        log.info("the drafter's fc passes aux layer %d, its norm and lm_head are the target's (--init-head)",
                 max(src.store.aux_layers))
    return drafter, None


def drafter_from(cfg: TrainConfig, src: StageInputs) -> tuple[Eagle3Drafter, InitReport]:
    """The drafter at `--init-from`, under its own mapping or remapped into stage 03's (finetune.py)."""
    info, store = src.info, src.store
    dcfg_dict, state, report = load_initial_drafter(
        cfg.init_from, aux_layers=store.aux_layers, num_target_layers=info.num_layers,
        target_hidden=info.hidden_size, target_vocab=info.vocab_size, our_ids=target_ids(src.d2t).numpy(),
        mode=cfg.vocab_mode, target_rows=lambda ids: load_lm_head(info, rows=torch.from_numpy(ids)),
        expected_from=str(store.manifest.path), shape=cfg.drafter_shape,
        target_family=target_family(info.architecture, info.text_config.get("model_type", info.model_type)))
    dcfg_dict["max_position_embeddings"] = max(dcfg_dict["max_position_embeddings"], info.max_position_embeddings)
    drafter = Eagle3Drafter(DrafterConfig.from_dict(dcfg_dict), attention=cfg.attention)
    missing, unexpected = drafter.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                   for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise PipelineError(f"{cfg.init_from}: tensors missing {missing} / unexpected {unexpected} for a "
                            f"drafter in the export format (docs/CONVENTIONS.md §6).")
    return drafter, report


def frozen_target_weights(cfg: TrainConfig, info: TargetInfo, drafter: Eagle3Drafter,
                          device: torch.device, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding [V_t, H] and its lm_head rows of the draft vocab [V_d, H] (labels)."""
    embed = load_embedding(info)
    if embed.shape[1] != drafter.config.hidden_size:
        raise PipelineError(f"{cfg.target_model}: embedding {tuple(embed.shape)} does not match vocab "
                            f"{info.vocab_size} x hidden {drafter.config.hidden_size}.")
    # Under bf16 on a GPU, bf16 halves the label rows (the labels' softmax upcasts to fp32
    # either way); --precision fp32 keeps fp32 everywhere, so it stays a reference run.
    dtype = torch.bfloat16 if bf16 and device.type == "cuda" else torch.float32
    lm_rows = load_lm_head(info, rows=drafter.draft_ids().cpu())
    # Under bf16 autocast every draft step reads the embedding as bf16 (Eagle3Drafter.step
    # casts it to the hidden's dtype): a bf16 table gives the same values without a cast of
    # [B, T, H] per step. The fp32 path keeps the fp32 table.
    embed_dtype = torch.bfloat16 if bf16 else dtype
    return embed.to(embed_dtype).to(device), lm_rows.to(dtype).to(device)


def check_start_figures(start: dict, cfg: TrainConfig, draft_vocab: int, mapping: str | Path) -> None:
    """Refuse a run whose held-out positions can train nothing, and a fine-tune (`--init-from`)
    that starts above the uniform loss ln(V_d) (unless --allow-bad-start): `start`, the held-out
    metrics before any update; `mapping`, where the token mapping came from."""
    uniform = math.log(draft_vocab)
    if start["num_valid"] == 0:
        raise PipelineError(
            f"no held-out position can be trained: the target's argmax is never in the draft vocabulary "
            f"of {draft_vocab} tokens, or the loss mask is empty. Check the mapping "
            f"({mapping}) against this target, and stage 01's loss mask.")
    # ce_0, the cross-entropy, whatever --loss trains: tv's or lk's loss_0 never exceeds ln V
    if cfg.init_from and not start["ce_0"] <= uniform:
        msg = (f"the starting held-out cross-entropy ce_0 {start['ce_0']:.3f} of {cfg.init_from} is worse "
               f"than uniform over the draft vocab (ln {draft_vocab} = {uniform:.3f}): its weights do not fit this "
               f"data. Usual causes: an lm_head read under another token mapping (try --vocab-mode keep or remap; "
               f"see the d2t comparison above) or other aux layer ids than the drafter was trained on. "
               f"Pass --allow-bad-start to train anyway.")
        if not cfg.allow_bad_start:
            raise PipelineError(msg)
        log.warning(msg)


# -- the trainer ---------------------------------------------------------------------
class Trainer:
    """One stage-04 run on this process: built from the checked inputs, driven by `fit`."""

    def __init__(self, cfg: TrainConfig, workdir: WorkDir, src: StageInputs, device: torch.device, dist: Dist):
        self.cfg, self.workdir, self.src, self.device, self.d = cfg, workdir, src, device, dist
        self.store = src.store

        # The drafter and the frozen target weights each step reads.
        drafter, self.init_report = build_drafter(cfg, src)
        self.drafter = drafter.to(device)
        self.drafter_config = drafter.config
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_autocast_pays(device))
        # [V_t, H], [V_d, H]
        self.embed, self.lm_rows = frozen_target_weights(cfg, src.info, drafter, device, self.bf16)
        self.local_ids = torch.arange(self.lm_rows.shape[0], device=device)  # lm_rows is already the draft vocab
        self.draft_ids = self.drafter.draft_ids().to(device)  # [V_d] target id of each draft row
        self.ttt = TTTConfig(num_steps=cfg.ttt_steps, step_decay=cfg.step_decay,
                             checkpoint_steps=cfg.checkpoint_steps, loss=cfg.loss_spec())
        # held-out acceptance under sampling: the target's whole lm_head, read at the first evaluation
        self.held_out_mass = HeldOutMass(lambda: load_lm_head(src.info), self.draft_ids, device)
        self.model = TTTModel(self.drafter, self.ttt)  # one forward = the whole K-step unroll (what DDP wraps)
        if dist.world > 1:
            self.model = wrap_ddp(self.model, device)  # no buffer broadcast: a forward is never a collective
        if dist.main:
            log_memory_prediction(cfg, self.drafter_config, device, dist)

        # The schedule: optimizer steps of grad_accum micro-batches per process.
        self.batching = Batching(cfg.batch_tokens, cfg.max_seq_len, cfg.seed, packed=cfg.packing)
        self.data = open_data_source(cfg, workdir, self.store, self.batching, dist, t2d=self.drafter.t2d,
                                     draft_vocab=self.drafter_config.draft_vocab_size)
        self.total = self.data.total
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt, self.sched = optimizer_and_schedule(self.params, cfg, self.total, dist.main)

        # Progress: with the weights, optimizer and RNG, what a checkpoint holds.
        self.step = 0
        self.resumed_from = 0  # the resumed checkpoint's own step (another process count numbers steps otherwise)
        self.best: dict = {"expected_accept_length": -1.0, "step": None}
        self.last_eval: dict | None = None
        self.metrics: MetricsLog | None = None  # opened by fit, once the resumed step is known
        self.new_window()

    # -- batches -----------------------------------------------------------------
    def micro_batches(self, step: int) -> list[list[int]]:
        """This process's micro-batches (sample indices) of optimizer step `step` (data_source.py)."""
        return self.data.micro_batches(step)

    def load(self, split, indices: list[int]) -> dict:
        return load_batch(split, indices, self.cfg.max_seq_len, packed=self.cfg.packing)

    def forward(self, batch: dict):
        """The K-step unroll over one micro-batch -> TTTOutput (loss, metrics); held-out batches
        carry `target_mass` [B, T] (evaluation.py), which adds the figures under sampling."""
        b = to_device(batch, self.device)  # an encoded fp8 batch is decoded there
        amax = b["target_argmax"].clamp_min(0)  # -1: padding or never a label; the masks exclude both
        probs = target_draft_distribution(self.local_ids, target_hidden=b["final"],
                                          lm_head_weight=self.lm_rows)  # [B, T, V_d]
        if self.cfg.loss_on == "all":
            # Stage 02 takes the full-vocab argmax next to assistant tokens only; elsewhere
            # the argmax over the draft rows stands in (padding stays masked either way).
            drafted = self.draft_ids[probs.argmax(dim=-1)]  # [B, T, V_d] -> [B, T] target ids
            amax = torch.where(b["target_argmax"] < 0, drafted, amax)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.model(b["aux"], b["input_ids"], self.embed, probs, amax, b["loss_mask"],
                              b["attention_mask"], b.get("position_ids"), b.get("segment_ids"), b.get("target_mass"))

    def training_view(self, batch: dict) -> dict:
        """What a train batch trains on: with --loss-on all every real token carries loss,
        with --aux-noise the aux states are perturbed. Held-out batches never pass here."""
        if self.cfg.loss_on == "all":
            batch["loss_mask"] = batch["attention_mask"].to(torch.int8)
        if self.cfg.aux_noise > 0:
            batch["aux"] = noisy_aux(batch["aux"], self.cfg.aux_noise, self.drafter_config.num_aux_layers)
        return batch

    # -- one optimizer step --------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the gradient norm.

        Nothing is updated unless the loss of every micro-batch and the gradient norm
        are finite: a NaN stops the run here, before `opt.step`, so the weights and
        the last checkpoint stay those of the last good step.
        """
        micro = self.micro_batches(self.step)
        self.opt.zero_grad(set_to_none=True)
        for i, idx in enumerate(micro):
            batch = self.training_view(self.data.batch(self.step, i, idx))
            self.window_tokens += int(batch["attention_mask"].sum())
            # DDP all-reduces gradients during backward. Accumulating micro-batches needs
            # that once per step, so no_sync skips it on all but the last micro-batch.
            last = i == len(micro) - 1
            with nullcontext() if (self.d.world == 1 or last) else self.model.no_sync():
                out = self.forward(batch)
                # One host sync per micro-batch. Under torchrun, the other ranks are
                # stopped by the launcher when this one exits.
                if not torch.isfinite(out.loss):
                    raise PipelineError(
                        f"non-finite loss {float(out.loss.detach())} at step {self.step} (micro-batch {i}); "
                        f"nothing was updated. Lower --learning-rate, check the store with `python -m "
                        f"eagle3.tools.diagnose`, or resume from an earlier checkpoint.")
                # Each micro-batch's loss is a mean over its positions; dividing by the
                # count makes the summed gradients the step's mean, whatever grad_accum is.
                (out.loss / len(micro)).backward()
            self.window.add(out.metrics)
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)  # the norm before clipping
        if not torch.isfinite(gnorm):
            raise PipelineError(f"non-finite gradient norm at step {self.step}; nothing was updated. Lower "
                                f"--learning-rate or --grad-clip, or resume from an earlier checkpoint.")
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(gnorm)

    # -- held-out metrics ------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out metrics over every held-out batch, summed over the ranks: the same figures
        whatever the number of processes (eagle3/stages/s04_train/evaluation.py)."""
        return evaluate_held_out(self.model, self.forward, self.load, self.store, self.batching,
                                 self.cfg.eval_batches, self.d, self.ttt.num_steps, self.held_out_mass)

    def evaluate_and_track(self) -> bool:
        """Evaluate, log, and keep the best; True when this step is the best so far."""
        m = self.last_eval = self.evaluate()
        self.metrics.write("eval", self.step, m)
        improved = m["expected_accept_length"] > self.best["expected_accept_length"]
        if improved:
            self.best = {"expected_accept_length": m["expected_accept_length"], "step": self.step, "metrics": m}
        log.info(fmt("eval", self.step, self.total, m, self.ttt.num_steps, " (best)" if improved else ""))
        return improved

    def check_start(self) -> None:
        """Held-out metrics before any update (logged as step 0), and the start gates.

        A fresh drafter starts near the uniform loss ln(V_d). A fine-tuned one must
        start below it: above it, its lm_head rows almost surely predict other tokens
        than this mapping says (see finetune.py), and training would first unlearn.
        """
        start = self.evaluate()
        self.metrics.write("eval", 0, start)
        V = self.drafter_config.draft_vocab_size
        log.info(fmt("start", 0, self.total, start, self.ttt.num_steps,
                     f" | ce_0 {start['ce_0']:.4f}, uniform ln({V}) = {math.log(V):.3f}"))
        check_start_figures(start, self.cfg, V, mapping=self.cfg.init_from or self.workdir.d2t())
        if self.cfg.init_from:
            # A fine-tune must never export something worse than its start: the starting
            # weights are the first candidate for best.pt, and a trained step replaces
            # them only with a higher held-out expected accept length.
            self.last_eval = start
            self.best = {"expected_accept_length": start["expected_accept_length"], "step": 0, "metrics": start}
            self.save(is_best=True)
            log.info("the initial drafter (held-out expected accept length %.3f) is saved as %s; a trained step "
                     "replaces it only by doing better", start["expected_accept_length"], self.workdir.best_checkpoint())

    # -- logging and checkpoints ----------------------------------------------------
    def new_window(self) -> None:
        """Start a log interval: its metric sums, token count and clock."""
        self.window, self.window_tokens, self.window_t0 = MetricSum(self.cfg.ttt_steps), 0, time.perf_counter()

    def log_train(self, gnorm: float) -> None:
        self.window.all_reduce(self.d.world)
        m = self.window.result()
        dt = time.perf_counter() - self.window_t0
        m.update(lr=self.sched.get_last_lr()[0], grad_norm=gnorm,
                 tokens_per_s=self.window_tokens * self.d.world / dt)
        self.metrics.write("train", self.step, m)
        log.info(fmt("train", self.step, self.total, m, self.ttt.num_steps,
                     f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | {m['tokens_per_s']:.0f} tok/s"))
        self.new_window()

    def state_dict(self, rng: list[dict], evaluated: dict) -> TrainCheckpoint:
        """Everything a resume needs (eagle3/artifacts/train_outputs.py `TrainCheckpoint`); `rng`:
        every rank's generator states, gathered by `save`; `evaluated`: the held-out metrics
        at this step ({} when not evaluated here)."""
        return TrainCheckpoint(
            model=self.drafter.state_dict(), drafter_config=self.drafter_config.to_dict(), aux_layers=self.store.aux_layers,
            optimizer=self.opt.state_dict(), scheduler=self.sched.state_dict(), step=self.step,
            **self.data.position(self.step), batch_geometry=self.batch_geometry(),
            rounds_trained=self.data.rounds_trained(self.step), rng=rng,
            train_config=json.loads(json.dumps(self.src.params, default=str)), identity=self.src.identity,
            best=self.best, eval=evaluated)

    def batch_geometry(self) -> dict:
        """What decides the samples of each step, the process count included (a checkpoint records it)."""
        cfg = self.cfg
        return {"processes": self.d.world, "grad_accum": cfg.grad_accum, "batch_tokens": cfg.batch_tokens,
                "max_seq_len": cfg.max_seq_len, "packing": cfg.packing}

    def load_state_dict(self, ckpt: TrainCheckpoint) -> None:
        self.drafter.load_state_dict(ckpt.model)
        self.opt.load_state_dict(ckpt.optimizer)
        self.sched.load_state_dict(ckpt.scheduler)
        set_rng_state(ckpt.rng, self.d.rank, self.d.world, self.device)
        self.step, self.best = ckpt.step, ckpt.best
        # Another process count may go on at another step (over windows), or be refused.
        step = self.data.resume_step(ckpt, self.workdir.checkpoint(ckpt.step))
        if step != ckpt.step:
            self.step = step
            move_schedule(self.opt, self.sched, step)

    def save(self, is_best: bool, evaluated: bool = False) -> None:
        """Write this step's checkpoint; it records the held-out metrics when it is the best or,
        under --keep-evaluated N > 1, whenever this step was evaluated (what marks a candidate)."""
        # A collective: every rank calls save at the same steps (the reduced held-out
        # metrics make is_best the same on all), and each rank's own RNG state is written.
        rng = rng_states_of_all_ranks(self.device)
        if self.d.main:  # the ranks hold the same weights (DDP)
            ckpt = self.state_dict(rng, self.last_eval if is_best or evaluated else {})
            save_checkpoint(self.workdir, ckpt, keep=self.cfg.keep_checkpoints, is_best=is_best,
                            keep_evaluated=self.cfg.keep_evaluated)

    def resume(self) -> None:
        ckpt = latest_checkpoint(self.workdir, self.src.identity)
        path = self.workdir.checkpoint(ckpt.step) if ckpt is not None else None
        ckpt = self.data.resumed(ckpt, path)
        if ckpt is not None:
            self.load_state_dict(ckpt)
            self.resumed_from = ckpt.step
            log.info("resuming from %s at step %d of %d", path, self.step, self.total)

    # -- the loop ----------------------------------------------------------------------
    def fit(self) -> Manifest | None:
        """Train to `total` steps from the last checkpoint; the manifest, or None on --stop-after."""
        from tqdm import tqdm

        cfg = self.cfg
        self.resume()
        self.metrics = MetricsLog(  # drops lines past the resumed checkpoint; feeds the trackers of --report-to
            self.workdir, self.d.main, self.resumed_from, report_to=cfg.report_to,
            run_config=run_config(self.src.params, self.src.identity, self.src.inputs, self.drafter_config.to_dict(),
                                  self.store.aux_layers, self.d.world, all_settings(cfg)) if self.d.main else None)
        bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step", disable=not self.d.main)
        self.data.start_prefetch(self.step, self.device)
        try:
            if self.step == 0:
                self.check_start()
            self.drafter.train()
            self.new_window()
            while self.step < self.total:
                if not self.data.ready(self.step):
                    return None  # the next round is not extracted yet; its checkpoint is on disk
                gnorm = self.train_step()
                bar.update(1)
                end = self.step == self.total
                # The last step of a round is always saved: its folder is deleted only then.
                part_end = self.data.ends_part(self.step)
                if self.step % cfg.log_every == 0 or end:
                    self.log_train(gnorm)
                evaluated = self.step % cfg.eval_every == 0 or end
                is_best = evaluated and self.evaluate_and_track()
                # --keep-evaluated N > 1: every evaluated step is saved, with its held-out metrics.
                candidate = evaluated and cfg.keep_evaluated > 1
                if is_best or candidate or self.step % cfg.save_every == 0 or end or part_end:
                    self.save(is_best, evaluated=candidate)
                if part_end:
                    self.data.covered(self.step, self.workdir.checkpoint(self.step))
                if cfg.stop_after is not None and cfg.stop_after <= self.step < self.total:
                    log.warning("--stop-after %d: stopping here as if killed; rerun without it to resume",
                                cfg.stop_after)
                    return None
        finally:
            self.data.close()  # also on KeyboardInterrupt: the loader thread stops
            bar.close()
            self.metrics.close()
        return self.finish()

    def finish(self) -> Manifest | None:
        """The stage's manifest (rank 0): the best held-out figures and where its checkpoint is."""
        if not self.d.main:
            return None
        workdir, best = self.workdir, self.best
        # With --init-from the starting weights are step 0's candidate (check_start).
        best_is_initial = best["step"] == 0
        counts = {**self.data.counts(self.step), "processes": self.d.world, "best_is_initial": best_is_initial,
                  "final_eval": self.last_eval}
        record = TrainRecord(
            ttt_steps=self.ttt.num_steps, aux_layer_ids=list(self.store.aux_layers), steps=self.step,
            best_step=best["step"], best_expected_accept_length=best["expected_accept_length"],
            best_eval=best.get("metrics"),
            best_checkpoint=workdir.best_checkpoint().relative_to(workdir.stage_dir("train")).as_posix())
        extra = {"drafter_config": self.drafter_config.to_dict(),
                 "init_from": self.init_report.to_json() if self.init_report else None}
        m = write_manifest(workdir, "train", params=self.src.params, inputs=self.src.inputs, counts=counts,
                           outputs=[workdir.best_checkpoint(), workdir.train_metrics()], record=record, extra=extra,
                           hash_outputs=False)
        if best_is_initial:
            log.warning("no trained step beat the initial drafter (held-out expected accept length %.3f at step 0); "
                        "best.pt holds the initial weights of %s: lower --learning-rate, or fine-tune on more data",
                        best["expected_accept_length"], self.cfg.init_from)
        for line in end_of_run_lines(workdir, self.step, self.ttt.num_steps, best, self.last_eval, self.step,
                                     self.cfg.init_from):
            log.info("%s", line)
        return m


# -- the stage -------------------------------------------------------------------------
def train_drafter(cfg: TrainConfig) -> Manifest | None:
    """Stage 04's entry point: the manifest, or None on a rank other than 0 or on --stop-after."""
    workdir = WorkDir(cfg.work_dir)
    device = pick_device(cfg.device)
    configure_cuda_allocator(device)  # before init_distributed: torch reads it when CUDA initialises
    d = init_distributed(device, timeout_s=cfg.dist_timeout_s)
    try:
        src = read_inputs(cfg, workdir)
        done = already_complete(workdir, "train", src.params, src.inputs, force=cfg.force)
        if done:
            return done
        # One trainer per work dir: a second one (a rerun while the first still trains, a --force
        # beside it) would prune the other's newer checkpoints, move latest.json back and append
        # to its metrics. Rank 0 claims 04_train before it deletes or writes anything there.
        claim = (claims.Claim.acquire(workdir.stage_dir("train"), what="stage 04",
                                      take_over_stale_s=cfg.take_over_stale_s) if d.main else None)
        try:
            if claim is not None and cfg.force:
                claims.empty_but_claim(workdir.stage_dir("train"), claim)  # every earlier run's file
                # Over windows, training from scratch needs every round again: stage 02 re-extracts
                # the ones deleted once no round counts as trained.
                wdir = windows_dir(workdir.store(), cfg.windows_dir)
                if read_plan(workdir.store()) is not None and (wdir / PROGRESS_JSON).is_file():
                    (wdir / PROGRESS_JSON).unlink()
            barrier()  # no rank may read a checkpoint rank 0 is deleting
            manifest = Trainer(cfg, workdir, src, device, d).fit()
            # Every rank leaves together: a rank that tears its group down while rank 0 still
            # writes the manifest can abort in the transport's teardown (gloo) after a good run.
            # Only on success: after an exception on one rank, a barrier would wait for its timeout.
            barrier()
            return manifest
        finally:
            if claim is not None:
                claim.release()
    finally:
        close_distributed(d)


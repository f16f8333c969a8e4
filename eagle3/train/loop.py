"""Stage 04: train the drafter with train-time-test unrolling; resumable; DDP.

Reads stage 02's store (aux states, the target's normed final state and argmax),
stage 03's mapping, and the target's embedding and draft-vocab lm_head rows
(from its safetensors, never the whole model). Writes (see eagle3/workdir.py):

    04_train/checkpoints/step-NNNNNNN.pt, best.pt, latest.json
    04_train/metrics.jsonl      one JSON line per log interval and evaluation
    04_train/tensorboard/       when tensorboard is installed
    04_train/manifest.json      best held-out expected accept length and its checkpoint

Run: `python 04_train_drafter.py --config configs/tiny-llama.yaml`, or on 8 GPUs
`torchrun --nproc-per-node 8 04_train_drafter.py --config configs/kimi-k2.5.yaml`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..cpu import bf16_pays
from ..drafter_io import drafter_config_for_target
from ..config import identity_params
from ..errors import PipelineError
from ..extract.target_head import _candidates, load_lm_head, load_tensors
from ..manifest import completed, manifest_fingerprint, read_manifest, sha256_file, sha256_json, write_manifest
from ..model import DrafterConfig, Eagle3Drafter
from ..store import HiddenStateStore
from ..target import TargetInfo, read_target_info
from ..ttt import TTTConfig, TTTModel, target_draft_distribution
from ..workdir import WorkDir
from .checkpoint import latest_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import TrainConfig
from .data import Batching, epoch_batches, load_batch, rank_batches
from .finetune import load_initial_drafter
from .memory import GIB, predict_peak

log = logging.getLogger(__name__)


# -- setup -------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError("--device cuda, but torch sees no GPU; use --device cpu or install a CUDA torch.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(choice)


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


# -- metrics -----------------------------------------------------------------------
class MetricSum:
    """Sums of per-batch metrics weighted by each batch's valid-position count.

    full_acc_k are exact over the summed positions; cond_acc_k is then derived
    from them (full_k / full_{k-1}); loss_k is the valid-weighted mean.
    """

    def __init__(self, K: int):
        self.K = K
        self.v = torch.zeros(2 * K + 1, dtype=torch.float64)  # loss_k*n, full_k*n, n

    def add(self, m: dict) -> None:
        n = m["num_valid"]
        self.v += torch.tensor([m[f"loss_{k}"] * n for k in range(self.K)]
                               + [m[f"full_acc_{k}"] * n for k in range(self.K)] + [n], dtype=torch.float64)

    def all_reduce(self, d: Dist) -> None:
        if d.world > 1:
            dist.all_reduce(self.v)

    def result(self) -> dict:
        K, n = self.K, float(self.v[-1])
        out: dict = {"num_valid": n}
        full = [float(self.v[K + k]) / n if n else 0.0 for k in range(K)]
        for k in range(K):
            out[f"loss_{k}"] = float(self.v[k]) / n if n else float("nan")
            out[f"full_acc_{k}"] = full[k]
            prev = 1.0 if k == 0 else full[k - 1]
            out[f"cond_acc_{k}"] = full[k] / prev if prev > 0 else 0.0
        out["expected_accept_length"] = 1.0 + sum(full)
        return out


class MetricsLog:
    """Rank 0: metrics.jsonl (appended; resumed runs continue it) and TensorBoard if installed."""

    def __init__(self, wd: WorkDir, d: Dist, resume_step: int):
        self.enabled = d.main
        self.path = wd.train_metrics()
        self.tb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # drop lines past the checkpoint we resume from
            keep = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(k + "\n" for k in keep))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(wd.tensorboard_dir()))
        except ImportError:
            log.info("tensorboard is not installed; metrics go to %s only", self.path)

    def write(self, split: str, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"split": split, "step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def fmt(split: str, step: int, total: int, m: dict, extra: str = "") -> str:
    K = sum(1 for k in m if k.startswith("full_acc_"))
    accs = " ".join(f"{m[f'full_acc_{k}']:.3f}" for k in range(K))
    return (f"{split:5s} step {step:6d}/{total} | loss_0 {m['loss_0']:.4f} | full_acc {accs} | "
            f"accept_len {m['expected_accept_length']:.3f}{extra}")


def bf16_autocast_pays(device: torch.device) -> bool:
    """`precision: auto`: bf16 autocast on GPU, and on CPUs with bf16 matmuls in hardware
    (eagle3/cpu.py); elsewhere fp32, where emulated bf16 is slower than fp32."""
    return device.type == "cuda" or bf16_pays()


# -- the stage ---------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainConfig, wd: WorkDir, store: HiddenStateStore, drafter: Eagle3Drafter,
                 embed: torch.Tensor, lm_rows: torch.Tensor, device: torch.device, d: Dist):
        self.cfg, self.wd, self.store, self.device, self.d = cfg, wd, store, device, d
        self.drafter = drafter.to(device)
        self.embed = embed.to(device)  # [V_t, H] frozen
        self.lm_rows = lm_rows.to(device)  # [V_d, H] target lm_head rows of the draft vocab
        self.local_ids = torch.arange(lm_rows.shape[0], device=device)
        self.ttt = TTTConfig(num_steps=cfg.ttt_steps, step_decay=cfg.step_decay,
                             checkpoint_steps=cfg.checkpoint_steps)
        model = TTTModel(self.drafter, self.ttt)
        if d.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = model
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_autocast_pays(device))
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        self.batching = Batching(cfg.batch_tokens, cfg.max_seq_len, cfg.seed, packed=cfg.packing)

    def load(self, split, indices: list[int]) -> dict:
        return load_batch(split, indices, self.cfg.max_seq_len, packed=self.cfg.packing)

    def forward(self, batch: dict):
        b = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        amax = b["target_argmax"].clamp_min(0)  # -1: padding or never a label; the masks exclude both
        probs, _ = target_draft_distribution(self.local_ids, target_hidden=b["final"],
                                             lm_head_weight=self.lm_rows, target_argmax=amax)
        with self.autocast():
            return self.model(b["aux"], b["input_ids"], self.embed, probs, amax, b["loss_mask"],
                              b["attention_mask"], b.get("position_ids"), b.get("segment_ids"))

    @torch.no_grad()
    def evaluate(self) -> dict:
        split = self.store.split("eval")
        if len(split) == 0:
            split = self.store.split("train")
            log.warning("the held-out split is empty; evaluating on train batches (rerun stage 01 with a "
                        "larger --eval-fraction for an honest figure)")
        batches = rank_batches(epoch_batches(split.lengths(), self.batching, None), self.d.rank, self.d.world)
        if self.cfg.eval_batches:
            batches = batches[: self.cfg.eval_batches]
        self.model.eval()
        acc = MetricSum(self.ttt.num_steps)
        for idx in batches:
            acc.add(self.forward(self.load(split, idx)).metrics)
        acc.all_reduce(self.d)
        self.model.train()
        return acc.result()


def log_memory_prediction(cfg: TrainConfig, dcfg: DrafterConfig, device: torch.device, d: Dist) -> None:
    """Log eagle3/train/memory.py's predicted peak per process (bf16 autocast, as on GPUs);
    warn when it exceeds 85% of this GPU."""
    # The reference attention's score blocks span a whole row: a packed row is batch_tokens long.
    row = cfg.batch_tokens if (cfg.packing and cfg.attention == "reference") else cfg.max_seq_len
    est = predict_peak(dcfg, ttt_steps=cfg.ttt_steps, batch_tokens=cfg.batch_tokens, row_len=row,
                       attention=cfg.attention, checkpoint_steps=cfg.checkpoint_steps, ddp=d.world > 1)
    log.info("predicted peak memory per process under bf16 autocast (--batch-tokens %d, --max-seq-len %d, "
             "--attention %s, --checkpoint-steps %s): %s", cfg.batch_tokens, cfg.max_seq_len, cfg.attention,
             cfg.checkpoint_steps, est.summary())
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if est.total > 0.85 * total:
            log.warning("the prediction (%.1f GiB) exceeds 85%% of this GPU's %.1f GiB: expect an out-of-memory "
                        "error; lower --batch-tokens (raise --grad-accum to keep the step size) or pass "
                        "--checkpoint-steps", est.total / GIB, total / GIB)


def _target_embedding(info: TargetInfo) -> torch.Tensor:
    return load_tensors(info.source, {"embedding": _candidates(info, "model.embed_tokens.weight")})["embedding"]


def train_drafter(cfg: TrainConfig):
    wd = WorkDir(cfg.work_dir)
    device = pick_device(cfg.device)
    d = init_distributed(device)
    try:
        return _train(cfg, wd, device, d)
    finally:
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, wd: WorkDir, device: torch.device, d: Dist):
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    prep = read_manifest(wd, "prepare", needed_by="stage 04 (train)")
    vocab_m = read_manifest(wd, "vocab", needed_by="stage 04 (train)")
    store = HiddenStateStore.open(wd, needed_by="stage 04 (train)",
                                  tokenizer_fingerprint=prep.extra["tokenizer_fingerprint"],
                                  hidden_size=info.hidden_size, expected_from=str(prep.path))
    if store.vocab_size != info.vocab_size:
        raise PipelineError(f"the store was extracted from a target with vocab {store.vocab_size}, "
                            f"{cfg.target_model} has {info.vocab_size}; pass the same --target-model as stage 02.")
    d2t = torch.load(wd.d2t(), weights_only=True)
    t2d = torch.load(wd.t2d(), weights_only=True)
    if t2d.shape[0] != info.vocab_size:
        raise PipelineError(f"{wd.t2d()} covers {t2d.shape[0]} target ids, {cfg.target_model} has "
                            f"{info.vocab_size}; rerun stage 03 for this target.")
    our_ids = (d2t + torch.arange(len(d2t))).numpy()

    params = identity_params(cfg)
    inputs = {"extract": manifest_fingerprint(store.manifest), "vocab": manifest_fingerprint(vocab_m)}
    if cfg.init_from:
        inputs["init_from"] = {p.name: sha256_file(p) for p in sorted(Path(cfg.init_from).iterdir())
                               if p.suffix in (".json", ".safetensors")}
    identity = sha256_json({"params": params, "inputs": inputs})
    done = completed(wd, "train", params, inputs)
    if done and not cfg.force:
        log.info("stage 04 already complete with these inputs (%s); nothing to do. Pass --force to redo it.",
                 done.path)
        return done
    if cfg.force and d.main and wd.stage_dir("train").exists():
        shutil.rmtree(wd.stage_dir("train"))
    if d.world > 1:
        dist.barrier()

    # -- drafter -----------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    init_report = None
    if cfg.init_from:
        def target_rows(ids: np.ndarray) -> torch.Tensor:
            return load_lm_head(info, rows=torch.from_numpy(ids))

        dcfg_dict, state, init_report = load_initial_drafter(
            cfg.init_from, aux_layers=store.aux_layers, num_target_layers=info.num_layers,
            target_hidden=info.hidden_size,
            target_vocab=info.vocab_size, our_ids=our_ids, mode=cfg.vocab_mode, target_rows=target_rows,
            expected_from=str(store.manifest.path))
        dcfg_dict["max_position_embeddings"] = max(dcfg_dict["max_position_embeddings"], info.max_position_embeddings)
        dcfg = DrafterConfig.from_dict(dcfg_dict)
        drafter = Eagle3Drafter(dcfg, attention=cfg.attention)
        missing, unexpected = drafter.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                       for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise PipelineError(f"{cfg.init_from}: tensors missing {missing} / unexpected {unexpected} for a "
                                f"convention-6 drafter.")
    else:
        dcfg = drafter_config_for_target(info, cfg, len(d2t))
        if dcfg.num_aux_layers != store.num_aux:
            dcfg.num_aux_layers = store.num_aux
        drafter = Eagle3Drafter(dcfg, attention=cfg.attention)
        drafter.set_vocab_mapping(d2t, t2d)
    draft_ids = drafter.draft_ids().cpu()
    embed = _target_embedding(info)
    if embed.shape != (info.vocab_size, dcfg.hidden_size):
        raise PipelineError(f"{cfg.target_model}: embedding {tuple(embed.shape)} does not match vocab "
                            f"{info.vocab_size} x hidden {dcfg.hidden_size}.")
    emb_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm_rows = load_lm_head(info, rows=draft_ids).to(emb_dtype)
    trainer = Trainer(cfg, wd, store, drafter, embed.to(emb_dtype), lm_rows, device, d)
    if d.main:
        log_memory_prediction(cfg, dcfg, device, d)

    # -- schedule ----------------------------------------------------------------
    train = store.split("train")
    lengths = train.lengths()
    per_epoch = len(rank_batches(epoch_batches(lengths, trainer.batching, 0), d.rank, d.world)) // cfg.grad_accum
    if per_epoch == 0:
        raise PipelineError(f"the train split ({len(train)} samples) gives no full step of {cfg.grad_accum} "
                            f"micro-batch(es) on each of {d.world} process(es); lower --grad-accum or --batch-tokens.")
    total = cfg.max_steps or cfg.epochs * per_epoch
    params_to_train = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params_to_train, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(min(cfg.warmup_steps, total), total, cfg.min_lr_ratio))

    step, best = 0, {"expected_accept_length": -1.0, "step": None}
    ckpt = latest_checkpoint(wd, identity)
    if ckpt is not None:
        drafter.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt["rng"])
        step, best = ckpt["step"], ckpt["best"]
        log.info("resuming from %s at step %d of %d", wd.checkpoint(step), step, total)
    mlog = MetricsLog(wd, d, step)

    def checkpoint(is_best: bool, eval_metrics: dict | None) -> None:
        if not d.main:
            return
        save_checkpoint(wd, {
            "model": drafter.state_dict(), "drafter_config": dcfg.to_dict(), "aux_layers": store.aux_layers,
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
            "epoch": step // per_epoch, "batch_in_epoch": step % per_epoch, "rng": rng_state(),
            "train_config": json.loads(json.dumps(params, default=str)), "identity": identity,
            "eval": eval_metrics or {}, "best": best,
        }, keep=cfg.keep_checkpoints, is_best=is_best)

    def evaluate_and_track() -> dict:
        m = trainer.evaluate()
        mlog.write("eval", step, m)
        improved = m["expected_accept_length"] > best["expected_accept_length"]
        if improved:
            best.update(expected_accept_length=m["expected_accept_length"], step=step, metrics=m)
        log.info(fmt("eval", step, total, m, " (best)" if improved else ""))
        return m

    # -- starting point: held-out metrics before any update --------------------------
    if step == 0:
        start = trainer.evaluate()
        mlog.write("eval", 0, start)
        uniform = math.log(dcfg.draft_vocab_size)
        log.info(fmt("start", 0, total, start, f" | uniform loss ln({dcfg.draft_vocab_size}) = {uniform:.3f}"))
        if start["num_valid"] == 0:
            raise PipelineError(
                f"no held-out position can be trained: the target's argmax is never in the draft vocabulary "
                f"of {dcfg.draft_vocab_size} tokens, or the loss mask is empty. Check the mapping "
                f"({cfg.init_from or wd.d2t()}) against this target, and stage 01's loss mask.")
        if cfg.init_from and not start["loss_0"] <= uniform:
            msg = (f"the starting held-out loss_0 {start['loss_0']:.3f} of {cfg.init_from} is worse than uniform "
                   f"over the draft vocab (ln {dcfg.draft_vocab_size} = {uniform:.3f}): its weights do not fit "
                   f"this data. Usual causes: an lm_head read under another token mapping (try --vocab-mode "
                   f"keep or remap; see the d2t comparison above) or other aux layer ids than the drafter was "
                   f"trained on. Pass --allow-bad-start to train anyway.")
            if not cfg.allow_bad_start:
                raise PipelineError(msg)
            log.warning(msg)

    # -- the loop ------------------------------------------------------------------
    from tqdm import tqdm

    drafter.train()
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not d.main)
    window, t0, tokens = MetricSum(cfg.ttt_steps), time.perf_counter(), 0
    epoch_cache: dict[int, list[list[int]]] = {}
    last_eval = None
    while step < total:
        epoch, b = divmod(step, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: rank_batches(epoch_batches(lengths, trainer.batching, epoch), d.rank, d.world)}
        micro = epoch_cache[epoch][b * cfg.grad_accum:(b + 1) * cfg.grad_accum]
        opt.zero_grad(set_to_none=True)
        for i, idx in enumerate(micro):
            batch = trainer.load(train, idx)
            tokens += int(batch["attention_mask"].sum())
            sync = nullcontext() if (d.world == 1 or i == len(micro) - 1) else trainer.model.no_sync()
            with sync:
                out = trainer.forward(batch)
                if not torch.isfinite(out.loss):
                    raise PipelineError(f"non-finite loss {float(out.loss)} at step {step} (epoch {epoch}, batch "
                                        f"{b}); lower --learning-rate, check the store with `python -m "
                                        f"eagle3.diagnose`, or resume from an earlier checkpoint.")
                (out.loss / len(micro)).backward()
            window.add(out.metrics)
        gnorm = torch.nn.utils.clip_grad_norm_(params_to_train, cfg.grad_clip)
        if not torch.isfinite(gnorm):
            raise PipelineError(f"non-finite gradient norm at step {step}; lower --learning-rate or --grad-clip, "
                                f"or resume from an earlier checkpoint.")
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == total:
            window.all_reduce(d)
            m = window.result()
            dt = time.perf_counter() - t0
            m.update(lr=sched.get_last_lr()[0], grad_norm=float(gnorm), tokens_per_s=tokens * d.world / dt)
            mlog.write("train", step, m)
            log.info(fmt("train", step, total, m, f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
                                                  f"{m['tokens_per_s']:.0f} tok/s"))
            window, t0, tokens = MetricSum(cfg.ttt_steps), time.perf_counter(), 0
        is_best = False
        if step % cfg.eval_every == 0 or step == total:
            prev_best = best["expected_accept_length"]
            last_eval = evaluate_and_track()
            is_best = best["expected_accept_length"] > prev_best
        if is_best or step % cfg.save_every == 0 or step == total:
            checkpoint(is_best, last_eval if is_best else None)
        if cfg.stop_after is not None and step >= cfg.stop_after and step < total:
            log.warning("--stop-after %d: stopping here as if killed; rerun without it to resume", cfg.stop_after)
            bar.close()
            mlog.close()
            return None
    bar.close()
    mlog.close()

    if not d.main:
        return None
    counts = {"steps": step, "steps_per_epoch": per_epoch, "processes": d.world,
              "best_step": best["step"], "best_expected_accept_length": best["expected_accept_length"],
              "final_eval": last_eval, "best_eval": best.get("metrics")}
    extra = {"best_checkpoint": wd.best_checkpoint().relative_to(wd.stage_dir("train")).as_posix(),
             "drafter_config": dcfg.to_dict(), "aux_layers": store.aux_layers,
             "init_from": init_report.to_json() if init_report else None}
    m = write_manifest(wd, "train", params=params, inputs=inputs, counts=counts,
                       outputs=[wd.best_checkpoint(), wd.train_metrics()], extra=extra, hash_outputs=False)
    log.info("stage 04: %d steps; best held-out expected accept length %.3f at step %s -> %s", step,
             best["expected_accept_length"], best["step"], wd.best_checkpoint())
    return m

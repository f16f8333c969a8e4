"""Our stage 04 side by side with a peer's trainer: same data, same budget, served.

    python bench/bench_quality.py                        # the demo: configs/smollm2-135m.yaml's work dir and target
    python bench/bench_quality.py --work-dir W --target-model M [--out DIR] [--sampled]
    python bench/bench_quality.py ... --steps 5 --warmup-steps 2          # a short shake-out of the whole path
    python bench/bench_quality.py --peer speculators [--peer-loss lk_hybrid] [--loss NAME] [--train-arg=--FLAG=V]

The peers: SpecForge 0.2.0's training step (`--peer specforge`, the default) and
speculators 0.9.0's trainer with its LK loss (`--peer speculators`; `--peer-loss` takes any
loss it ships: kl_div, rkl, jsd, ce, tv, nla, lk_hybrid, or a JSON dict of weights).
The speculators comparison at the demo's size, two seeds (the lead's measurement; each
seed its own --out, so that both seeds' runs, logs and reports are kept side by side):

    for seed in 0 1; do python bench/bench_quality.py --peer speculators --sampled --seed $seed \
        --out work/smollm2-135m/bench_quality-speculators-seed$seed [--loss lk_lambda]; done

(250 steps, the config's; speculators' side takes ~8 s a step on 2 idle cores, twice that
beside another job, so about 50 minutes a seed in all, docs/LEVERS.md; `--loss` gives our
stage 04 any of its losses; the tiny shake-out:
`python bench/bench_quality.py --config configs/tiny-llama.yaml --peer speculators --steps 5 --warmup-steps 2`).

On one stage-02 store and stage-03 vocabulary (the base work dir W, stages 00-03 done),
with one budget (optimizer steps, the same samples in each step, tokens per step,
K = ttt_steps, peak learning rate and warmup; defaults: the config's train section),
on CPU:

1. ours: stage 04, 05 and 06 in OUT/ours, whose 00-03 folders are symlinks to W's;
   `--loss NAME` and `--train-arg ARG` (repeatable) pass flags to our stage 04 only;
2. the peer: its own drafter class, TTT forward, loss, optimizer and schedule
   (bench/specforge_bridge.py and bench/speculators_bridge.py say which of its files and
   what had to change for a CPU), installed into --specforge-env / --speculators-env by this
   script when missing. Step s trains on the samples step s of our stage 04 trains on: both
   read eagle3/stages/s04_train/run.py `Trainer`'s plan (EpochPlan over the samples that
   carry loss); SpecForge gets them as its collator's padded batch, speculators as its
   collator's one packed row, ours packs them into rows. Its weights are converted to our
   export format, checked logit for logit against our `Eagle3Drafter` (fails above the
   bridge's CHECK_TOLERANCE), written as a stage-04 checkpoint and exported by stage 05 in
   OUT/<peer>, then served by stage 06 there;
3. both drafters served by stage 06 on the config's held-out prompts, greedy (and
   T = 0.7 with --sampled), no untrained baseline, no timing.

Prints, per trainer: served acceptance length with its 95% interval and per position,
the held-out expected accept length (docs/CONVENTIONS.md §5; for the peer our stage 04's
own evaluation of its weights at the same steps), seconds per optimizer step (median;
SpecForge's share spent on its teacher beside it), the precision each trained in; then
ours minus the peer's served acceptance length, whether ours lies above the peer's 95%
interval, and the paired 95% interval of the difference over the same prompts
(bench/served_pairs.py). OUT defaults to W/bench_quality (W's own stage folders are
never written); every figure is also in OUT/bench_quality.json, the stages' logs in
OUT/logs/. Rerunning reuses finished stages and a finished peer run of the same
settings (--force redoes them).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import specforge_bridge as bridge  # noqa: E402
import speculators_bridge as spec_bridge  # noqa: E402
from served_pairs import paired_interval, per_prompt, verdict  # noqa: E402

from eagle3.core.config import build_config, load_yaml  # noqa: E402
from eagle3.stages.s04_train.config import TrainConfig  # noqa: E402
from eagle3.artifacts.workdir import WorkDir  # noqa: E402
from eagle3.stages.configs import STAGE_CONFIGS  # noqa: E402

UPSTREAM = ("generate", "prepare", "extract", "vocab")  # the stages both scratch work dirs share with W
BUDGET = ("max_steps", "batch_tokens", "ttt_steps", "learning_rate", "warmup_steps", "seed")
CHECK_SAMPLES = 4  # held-out samples through both models in the logit check


def say(line: str = "") -> None:
    print(line, flush=True)


# --------------------------------------------------------------------------- work dirs and stages


def scratch_work_dir(path: Path, base: WorkDir) -> WorkDir:
    """A work dir whose upstream stage folders are symlinks to `base`'s."""
    workdir = WorkDir(path)
    path.mkdir(parents=True, exist_ok=True)
    for stage in UPSTREAM:
        link, src = workdir.stage_dir(stage), base.stage_dir(stage)
        if src.exists() and not link.exists():
            link.symlink_to(src.resolve(), target_is_directory=True)
    return workdir


def run_stage(stage: str, workdir: WorkDir, common: list[str], extra: list[str], logs: Path, name: str) -> float:
    """Run one numbered script on `wd`; its output goes to OUT/logs/NAME-NN.log. Seconds taken."""
    script = ROOT / WorkDir.script(stage)
    log_path = logs / f"{name}-{WorkDir.number(stage)}.log"
    env = dict(os.environ)
    if not env.get("VLLM_CPU_OMP_THREADS_BIND"):  # as scripts/demo.sh: every core to vLLM's model worker
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    cmd = [sys.executable, str(script), *common, "--work-dir", str(workdir.root), *extra]
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    dt = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log_path.read_text().splitlines(True)[-15:])
        raise SystemExit(f"{name}: `{' '.join(cmd)}` failed (exit {rc}) after {dt:.0f} s; last lines of "
                         f"{log_path}:\n{tail}")
    say(f"  {name:10s} {WorkDir.script(stage):28s} {dt:6.0f} s   (log {log_path})")
    return dt


# --------------------------------------------------------------------------- the shared plan


def make_trainer(cfg: TrainConfig):
    """Our stage 04's Trainer on a work dir, never fitted: its batch plan and its held-out evaluation."""
    from eagle3.stages.s04_train.distributed import Dist
    from eagle3.stages.s04_train.run import Trainer, read_inputs

    workdir = WorkDir(cfg.work_dir)
    return Trainer(cfg, workdir, read_inputs(cfg, workdir), torch.device("cpu"), Dist())


def plan_figures(trainer) -> dict:
    """Samples and tokens per step of the run's plan (the same for both trainers)."""
    lengths, L = trainer.data.lengths, trainer.cfg.max_seq_len
    samples, tokens, padded = [], [], []
    for s in range(trainer.total):
        micro = trainer.micro_batches(s)
        samples.append(sum(len(mb) for mb in micro))
        tokens.append(sum(min(lengths[i], L) for mb in micro for i in mb))
        padded.append(sum(len(mb) * max(min(lengths[i], L) for i in mb) for mb in micro))  # SpecForge's collator
    return {"steps": trainer.total, "samples_per_step": statistics.mean(samples), "tokens": tokens,
            "tokens_per_step": statistics.mean(tokens), "padded_tokens_per_step": statistics.mean(padded),
            "train_samples": len(trainer.data.plan.samples)}


# --------------------------------------------------------------------------- ours


def our_figures(workdir: WorkDir, plan: dict) -> dict:
    """Stage 04's held-out curve and seconds per step (from metrics.jsonl), stage 05's exported step."""
    from eagle3.artifacts.train_outputs import read_train_metrics

    rows = read_train_metrics(workdir)
    evals = {r["step"]: r for r in rows if r["split"] == "eval" and r["step"] > 0}
    # A log line's tokens/s covers the steps since the previous line; an evaluation (and the
    # checkpoint after it) runs after a line is written, so it falls into the next window:
    # windows holding one are left out of the timing.
    per_step, prev = [], 0
    for r in (r for r in rows if r["split"] == "train"):
        s = r["step"]
        if not any(prev <= e < s for e in evals) and r.get("tokens_per_s"):
            per_step.append(sum(plan["tokens"][prev:s]) / r["tokens_per_s"] / (s - prev))
        prev = s
    report = json.loads(workdir.export_report("json").read_text())
    return {"evals": evals, "s_per_step": statistics.median(per_step) if per_step else None,
            "timed_windows": len(per_step), "exported_step": report["checkpoint"]["step"]}


def our_precision(cfg: TrainConfig) -> str:
    from eagle3.stages.s04_train.run import bf16_autocast_pays

    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_autocast_pays(torch.device("cpu")))
    return "bf16 autocast, fp32 weights (stage 04 precision auto)" if bf16 else "fp32 (stage 04 precision auto)"


# --------------------------------------------------------------------------- the peers


def peer_precision(choice: str) -> str:
    """The peer's precision: `auto` is our stage 04's choice on this machine."""
    if choice != "auto":
        return choice
    from eagle3.stages.s04_train.run import bf16_autocast_pays

    return "autocast" if bf16_autocast_pays(torch.device("cpu")) else "fp32"


def save_peer_checkpoint(trainer, model_state: dict, final_eval: dict, path: Path) -> None:
    """A peer's converted weights as a stage-04 checkpoint stage 05 reads (TrainCheckpoint):
    our run's identity, shape, layers and data position at its last step, the peer's weights;
    no optimizer, schedule or RNG state (stage 05 reads none, and nothing resumes from it)."""
    from eagle3.artifacts.train_outputs import TrainCheckpoint

    step = trainer.total
    ckpt = TrainCheckpoint(
        model=model_state, drafter_config=trainer.drafter_config.to_dict(), aux_layers=list(trainer.store.aux_layers),
        optimizer={}, scheduler={}, step=step, **trainer.data.position(step),
        batch_geometry=trainer.batch_geometry(), rounds_trained=0, rng=[],
        train_config=json.loads(json.dumps(trainer.src.params, default=str)), identity=trainer.src.identity,
        best={"expected_accept_length": final_eval["expected_accept_length"], "step": step}, eval=final_eval)
    torch.save(ckpt.to_file(), path)


# --------------------------------------------------------------------------- SpecForge


def train_specforge(cfg: TrainConfig, args: argparse.Namespace, precision: str, workdir: WorkDir, force: bool) -> dict:
    """SpecForge's training on our plan; writes its weights, a stage-04 checkpoint of the
    converted weights (for stage 05) and a summary; returns the summary."""
    from eagle3.target.head import load_embedding, load_lm_head
    from eagle3.drafter.model import Eagle3Drafter

    summary_path, state_path, ckpt_path = (workdir.root / "specforge_train.json", workdir.root / "specforge_state.pt",
                                           workdir.root / "specforge_checkpoint.pt")
    trainer = make_trainer(cfg)
    s = bridge.SpecForgeSettings(target_model=cfg.target_model, ttt_steps=cfg.ttt_steps,
                                 learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                                 total_steps=trainer.total, max_seq_len=cfg.max_seq_len, precision=precision,
                                 seed=cfg.seed)
    settings = {**s.__dict__, "batch_tokens": cfg.batch_tokens, "grad_accum": cfg.grad_accum,
                "store": str(trainer.store.dir.resolve())}
    info = trainer.src.info
    sf = bridge.SpecForgeTrainer(s, trainer.drafter_config, trainer.drafter.d2t, trainer.drafter.t2d, load_lm_head(info),
                                 accumulation_steps=cfg.grad_accum)
    old = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if old and old.get("settings") == settings and state_path.is_file() and not force:
        say(f"  specforge  reusing {summary_path} (same settings; --force retrains)")
        sf.load_saved_state(torch.load(state_path, weights_only=True))
        summary = old
    else:
        summary = fit_specforge(sf, trainer, cfg, settings)
        torch.save(sf.saved_state(), state_path)
    # The conversion, checked logit for logit before anything is exported from it.
    drafter = Eagle3Drafter(trainer.drafter_config)
    drafter.load_state_dict(bridge.to_export_state(sf.saved_state()))  # strict: the names are ours exactly
    split = trainer.store.split("eval")
    n = min(CHECK_SAMPLES, len(split))
    check = bridge.check_conversion(sf, drafter, load_embedding(info).float(), [split[i] for i in range(n)],
                                    [f"eval-{i}" for i in range(n)], cfg.max_seq_len)
    summary["conversion_check"] = check
    summary_path.write_text(json.dumps(summary, indent=1))
    say(f"  specforge  logit check: max |SpecForge - ours| {check['max_abs_diff']:.2e} over {check['rows_compared']:,} "
        f"positions x {check['steps']} steps of {check['samples']} held-out samples (|logits| up to "
        f"{check['max_abs_logit']:.1f}; tolerance {check['tolerance']:.0e})")
    if not check["ok"]:
        raise SystemExit(f"the converted SpecForge weights do not give SpecForge's logits (max abs difference "
                         f"{check['max_abs_diff']:.3e} > {check['tolerance']:.0e}): the conversion in "
                         f"bench/specforge_bridge.py (to_export_state) no longer matches SpecForge's drafter; "
                         f"nothing was exported or served.")
    # Only a checked conversion becomes the checkpoint stage 05 exports.
    save_peer_checkpoint(trainer, bridge.to_export_state(sf.saved_state()), summary["evals"][str(trainer.total)],
                         ckpt_path)
    return summary


def fit_specforge(sf, trainer, cfg: TrainConfig, settings: dict) -> dict:
    """SpecForge's steps on our plan; our stage 04's held-out evaluation of its weights at our eval steps."""
    split, total = trainer.data.split, trainer.total
    eval_steps = {s for s in range(1, total + 1) if s % cfg.eval_every == 0 or s == total}
    step_s, teacher_s, evals, log = [], [], {}, []
    import specforge.algorithms.eagle3.model as sf_model

    teacher = sf_model.compute_target_p_padded_from_hidden
    spent = [0.0]

    def timed_teacher(*args, **kwargs):  # how much of a step is SpecForge's full-vocab teacher
        t0 = time.perf_counter()
        out = teacher(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    sf_model.compute_target_p_padded_from_hidden = timed_teacher
    try:
        for step in range(total):
            t0 = time.perf_counter()
            spent[0] = 0.0
            for mb in trainer.micro_batches(step):
                m = sf.train_step(sf.batch([split[i] for i in mb], [str(i) for i in mb]))
            step_s.append(time.perf_counter() - t0)
            teacher_s.append(spent[0])
            done = step + 1
            if done % cfg.log_every == 0 or done == total:
                line = {"step": done, "s_per_step": statistics.median(step_s[-cfg.log_every:]),
                        **{k: m[k] for k in sorted(m) if k.startswith(("ploss_", "acc_")) or k == "grad_norm"},
                        "lr": sf.backend.optimizer.get_learning_rate()}
                log.append(line)
                say(f"  specforge  step {done:4d}/{total}  " + "  ".join(
                    f"{k} {v:.3g}" for k, v in line.items() if k != "step"))
            if done in eval_steps:
                trainer.drafter.load_state_dict(bridge.to_export_state(sf.saved_state()))
                evals[str(done)] = trainer.evaluate()
                say(f"  specforge  step {done:4d}  held-out expected accept length "
                    f"{evals[str(done)]['expected_accept_length']:.3f} (our stage 04's evaluation of its weights)")
    finally:
        sf_model.compute_target_p_padded_from_hidden = teacher
    return {"settings": settings, "evals": evals, "log": log, "step_s": step_s, "teacher_s": teacher_s,
            "s_per_step": statistics.median(step_s), "teacher_s_per_step": statistics.median(teacher_s)}


# --------------------------------------------------------------------------- speculators


def train_speculators(cfg: TrainConfig, args: argparse.Namespace, precision: str, workdir: WorkDir, force: bool) -> dict:
    """speculators' training on our plan; writes its weights, a stage-04 checkpoint of the
    converted weights (for stage 05) and a summary; returns the summary."""
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.target.head import load_embedding, load_lm_head

    summary_path, state_path, ckpt_path = (workdir.root / "speculators_train.json", workdir.root / "speculators_state.pt",
                                           workdir.root / "speculators_checkpoint.pt")
    trainer = make_trainer(cfg)
    s = spec_bridge.SpeculatorsSettings(
        target_model=cfg.target_model, aux_layers=list(trainer.store.aux_layers), ttt_steps=cfg.ttt_steps,
        learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps, total_steps=trainer.total,
        max_seq_len=cfg.max_seq_len, precision=precision, seed=cfg.seed, loss=args.peer_loss,
        optimizer=args.peer_optimizer, scheduler=args.peer_scheduler, step_decay=args.peer_step_decay)
    steps = [[i for mb in trainer.micro_batches(step) for i in mb] for step in range(trainer.total)]
    settings = {**s.resolved(), "batch_tokens": cfg.batch_tokens, "grad_accum": cfg.grad_accum,
                "store": str(trainer.store.dir.resolve())}
    peer = spec_bridge.SpeculatorsTrainer(s, trainer.drafter_config, trainer.drafter.d2t, trainer.drafter.t2d,
                                          trainer.data.split, steps, workdir.root / "speculators_run")
    # Its teacher head is the target's lm_head rows its own loader picked by t2d: the rows ours reads.
    our_rows = load_lm_head(trainer.src.info, trainer.drafter.draft_ids())  # [V_d, H]
    if not torch.equal(peer.teacher_rows().float(), our_rows.float()):
        raise SystemExit(f"speculators' teacher head (verifier_lm_head, read by its load_verifier_weights from "
                         f"{cfg.target_model}) differs from the target's lm_head rows of our draft vocabulary: its "
                         f"loader and ours read the target's checkpoint differently; nothing was trained.")
    old = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if old and old.get("settings") == settings and state_path.is_file() and not force:
        say(f"  speculators reusing {summary_path} (same settings; --force retrains)")
        peer.load_saved_state(torch.load(state_path, weights_only=True))
        summary = old
    else:
        summary = fit_speculators(peer, trainer, cfg, settings)
        torch.save(peer.saved_state(), state_path)
    # The conversion, checked logit for logit before anything is exported from it.
    drafter = Eagle3Drafter(trainer.drafter_config)
    drafter.load_state_dict(spec_bridge.to_export_state(peer.saved_state()))  # strict: every name of ours, no other
    split = trainer.store.split("eval")
    check = spec_bridge.check_conversion(peer, drafter, load_embedding(trainer.src.info).float(), split,
                                         list(range(min(CHECK_SAMPLES, len(split)))), cfg.max_seq_len)
    summary["conversion_check"] = check
    summary_path.write_text(json.dumps(summary, indent=1))
    say(f"  speculators logit check: max |speculators - ours| {check['max_abs_diff']:.2e} over "
        f"{check['rows_compared']:,} positions x {check['steps']} steps of {check['samples']} held-out samples "
        f"(|logits| up to {check['max_abs_logit']:.1f}; tolerance {check['tolerance']:.0e})")
    if not check["ok"]:
        raise SystemExit(f"the converted speculators weights do not give speculators' logits (max abs difference "
                         f"{check['max_abs_diff']:.3e} > {check['tolerance']:.0e}): the conversion in "
                         f"bench/speculators_bridge.py (to_export_state) no longer matches its drafter; "
                         f"nothing was exported or served.")
    # Only a checked conversion becomes the checkpoint stage 05 exports.
    save_peer_checkpoint(trainer, spec_bridge.to_export_state(peer.saved_state()), summary["evals"][str(trainer.total)],
                         ckpt_path)
    return summary


def fit_speculators(peer, trainer, cfg: TrainConfig, settings: dict) -> dict:
    """speculators' train loop over our plan; our stage 04's held-out evaluation of its weights
    at our eval steps (outside the step times)."""
    total = trainer.total
    eval_steps = {s for s in range(1, total + 1) if s % cfg.eval_every == 0 or s == total}
    step_s, evals, log = [], {}, []
    clock = [time.perf_counter()]
    records: list[dict] = []

    def after_step(done: int) -> None:
        step_s.append(time.perf_counter() - clock[0])
        if done % cfg.log_every == 0 or done == total:
            m = records[-1]["train"] if records else {}
            line = {"step": done, "s_per_step": statistics.median(step_s[-cfg.log_every:]),
                    **{k: m[k] for k in sorted(m) if k.startswith(("loss", "full_acc_"))},
                    "lr": peer.learning_rates()[0]}
            log.append(line)
            say(f"  speculators step {done:4d}/{total}  " + "  ".join(
                f"{k} {v:.3g}" for k, v in line.items() if k != "step"))
        if done in eval_steps:
            trainer.drafter.load_state_dict(spec_bridge.to_export_state(peer.saved_state()))
            evals[str(done)] = trainer.evaluate()
            say(f"  speculators step {done:4d}  held-out expected accept length "
                f"{evals[str(done)]['expected_accept_length']:.3f} (our stage 04's evaluation of its weights)")
        clock[0] = time.perf_counter()

    peer.fit(after_step, records)  # each step's record is in `records` before after_step runs
    return {"settings": settings, "evals": evals, "log": log, "step_s": step_s,
            "s_per_step": statistics.median(step_s)}


# --------------------------------------------------------------------------- the report


def served_rows(workdir: WorkDir) -> list[dict]:
    r = json.loads(workdir.evaluate_results().read_text())
    return [{"temperature": row["temperature"], "L": row["trained"]["acceptance_length"],
             "ci95": row["trained"].get("ci95"), "per_position": row["trained"]["acceptance_per_position"],
             "prompts": r["prompts"].get("count") or r["prompts"].get("num_prompts")} for row in r["acceptance"]]


def estimate_text(evals: dict) -> str:
    return " / ".join(f"{float(m['expected_accept_length']):.3f} @{s}" for s, m in
                      sorted(evals.items(), key=lambda kv: int(kv[0])))


PEER_NAMES = {"specforge": "SpecForge", "speculators": "speculators"}


def peer_lines(peer: str, meta: dict, plan: dict, summary: dict) -> dict:
    """What the report says of the peer: its batch, recipe and the share of its step worth naming."""
    if peer == "specforge":
        return {"batch": f"SpecForge's collator pads them to {plan['padded_tokens_per_step']:,.0f}",
                "recipe": f"{meta['peer_precision']}; its BF16Optimizer (AdamW betas (0.9, 0.999) on fp32 masters, "
                          f"cosine to 0, clip 0.5); padded batch; exported its last step; {bridge.LOSS_SUBSTITUTION}",
                "step_note": f"of which its teacher, full-vocab logsumexp and argmax: "
                             f"{summary['teacher_s_per_step']:.2f}"}
    packed = plan["tokens_per_step"] - plan["samples_per_step"]  # its shift_batch drops one token per sample
    return {"batch": f"speculators' collator packs them into one row of {packed:,.0f}",
            "recipe": f"{meta['peer_precision']}; {spec_bridge.settings_text(summary['settings'])}; one packed row "
                      f"per step; exported its last step; on CPU: {spec_bridge.CPU_CHANGES}",
            "step_note": "dense sdpa over the packed row: its GPU flex attention skips the blocks across samples"}


def report(cfg: TrainConfig, plan: dict, ours: dict, peer: dict, served: dict, meta: dict,
           paired: dict[float, tuple[float, float]]) -> list[str]:
    K, key, name = cfg.ttt_steps, meta["peer"], PEER_NAMES[meta["peer"]]
    owner = name + ("'" if name.endswith("s") else "'s")  # speculators', SpecForge's
    said = peer_lines(key, meta, plan, peer)
    extra = f"; stage 04 flags {' '.join(meta['our_train_args'])}" if meta["our_train_args"] else ""
    out = [f"== bench_quality: our stage 04 vs {name} {meta['peer_version']} on {meta['work_dir']} "
           f"(target {cfg.target_model})",
           f"budget: {plan['steps']} optimizer steps, the same samples in each step ({plan['samples_per_step']:.1f} "
           f"samples, {plan['tokens_per_step']:,.0f} tokens per step on average; {said['batch']}), "
           f"{plan['train_samples']} train samples that carry loss, K = {K}, peak lr {cfg.learning_rate:g}, warmup "
           f"{cfg.warmup_steps} steps, seed {cfg.seed}, CPU",
           f"ours:      {meta['our_precision']}; AdamW betas (0.9, 0.95), cosine to {cfg.min_lr_ratio:g} x peak, "
           f"clip {cfg.grad_clip:g}; packed rows; exported its best held-out checkpoint (step "
           f"{ours['exported_step']}){extra}",
           f"{name + ':':10s} {said['recipe']}",
           f"conversion check: max |logit difference| {peer['conversion_check']['max_abs_diff']:.2e} "
           f"(tolerance {peer['conversion_check']['tolerance']:.0e})",
           ""]
    prompts = served["ours"][0]["prompts"]
    for i, row in enumerate(served["ours"]):
        t = row["temperature"]
        out.append(f"served acceptance length, K = {K}, {prompts} held-out prompts, "
                   f"{'greedy' if t == 0 else f'T = {t:g}'} (stage 06):")
        for label, side in (("ours", "ours"), (key, "peer")):
            r = served[side][i]
            per = " / ".join(f"{p:.2f}" for p in r["per_position"])
            ci = f" ±{r['ci95']:.3f}" if r["ci95"] is not None else ""
            out.append(f"  {label:11s} {r['L']:.3f}{ci}   per position {per}")
    out += ["",
            "training-time held-out expected accept length (1 + sum_k full_acc_k, our stage 04's evaluation):",
            f"  {'ours':11s} {estimate_text(ours['evals'])}",
            f"  {key:11s} {estimate_text(peer['evals'])}",
            "seconds per optimizer step (median):",
            f"  {'ours':11s} {ours['s_per_step']:.2f}   (stage 04's log windows without an evaluation: "
            f"{ours['timed_windows']})",
            f"  {key:11s} {peer['s_per_step']:.2f}   ({said['step_note']})",
            ""]
    o, s = served["ours"][0], served["peer"][0]
    if s["ci95"] is not None:
        hi = s["L"] + s["ci95"]
        where = (f"above {owner} 95% interval [{s['L'] - s['ci95']:.3f}, {hi:.3f}]" if o["L"] > hi else
                 f"not above {owner} 95% interval [{s['L'] - s['ci95']:.3f}, {hi:.3f}]")
    else:
        where = f"{owner} run has no interval"
    t = o["temperature"]
    out.append(f"ours - {name}: {o['L'] - s['L']:+.3f} served acceptance length "
               f"({'greedy' if t == 0 else f'T = {t:g}'}, K = {K}); ours is {where}")
    for t, (lo, hi) in paired.items():
        out.append(f"paired over the same prompts ({'greedy' if t == 0 else f'T = {t:g}'}): ours - {name} 95% "
                   f"interval [{lo:+.3f}, {hi:+.3f}]: ours {verdict(lo, hi)}")
    return out


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml",
                    help="config whose train section gives the budget and whose evaluate section the prompts")
    ap.add_argument("--work-dir", type=Path, help="base work dir with stages 00-03 done (default: the config's)")
    ap.add_argument("--target-model", help="target model folder (default: the config's)")
    ap.add_argument("--out", type=Path, help="where both runs go (default: WORK_DIR/bench_quality)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default: the config's train.max_steps)")
    ap.add_argument("--batch-tokens", type=int, help="tokens per step (default: the config's)")
    ap.add_argument("--ttt-steps", type=int, help="K, trained and served (default: the config's)")
    ap.add_argument("--learning-rate", type=float, help="peak learning rate (default: the config's)")
    ap.add_argument("--warmup-steps", type=int, help="warmup steps (default: the config's)")
    ap.add_argument("--seed", type=int, help="initialisation and data order (default: the config's)")
    ap.add_argument("--sampled", action="store_true", help="serve at T = 0.7 as well as greedy")
    ap.add_argument("--loss", help="our stage 04's --loss (passed as --loss=NAME; the peer's is --peer-loss)")
    ap.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for our stage 04 only, as one token (--train-arg=--step-decay=0.9); "
                         "repeatable")
    ap.add_argument("--peer", default="specforge", choices=sorted(PEER_NAMES),
                    help=f"whose trainer ours is compared with: SpecForge {bridge.SPECFORGE_VERSION} or speculators "
                         f"{spec_bridge.SPECULATORS_VERSION}")
    ap.add_argument("--peer-precision", "--specforge-precision", dest="peer_precision", default="auto",
                    choices=["auto", *bridge.PRECISIONS],
                    help="auto: as our stage 04 on this machine (bf16 autocast where bf16 matmuls are in "
                         "hardware, else fp32); bf16 (SpecForge only): its default bf16 weights with fp32 masters")
    ap.add_argument("--peer-loss", default=spec_bridge.DEFAULT_LOSS,
                    help="speculators' loss: kl_div, rkl, jsd, ce, tv, nla (-log acceptance, LK^alpha), lk_hybrid "
                         "(the LK paper's hybrid) or a JSON dict of weights, e.g. '{\"kl_div\": 0.5, \"tv\": 0.5}' "
                         "(SpecForge 0.2.0 has its KL only)")
    ap.add_argument("--peer-optimizer", choices=["muon", "adamw"],
                    help="speculators' optimizer (default: its CLI's, muon)")
    ap.add_argument("--peer-scheduler", choices=["linear", "cosine"],
                    help="speculators' schedule after the warmup (default: its CLI's, linear)")
    ap.add_argument("--peer-step-decay", type=float,
                    help="speculators' loss weight of TTT step k is this ** k (default: its CLI's, 1.0)")
    ap.add_argument("--specforge-env", type=Path,
                    default=ROOT / "work" / "bench-env" / f"specforge-{bridge.SPECFORGE_VERSION}",
                    help="folder SpecForge is installed into (--no-deps) and imported from")
    ap.add_argument("--speculators-env", type=Path,
                    default=ROOT / "work" / "bench-env" / f"speculators-{spec_bridge.SPECULATORS_VERSION}",
                    help="folder speculators is installed into (--no-deps) and imported from")
    ap.add_argument("--force", action="store_true", help="retrain and re-serve both instead of reusing")
    a = ap.parse_args()
    if a.peer == "specforge":
        chosen = [flag for flag, v in (("--peer-optimizer", a.peer_optimizer), ("--peer-scheduler", a.peer_scheduler),
                                       ("--peer-step-decay", a.peer_step_decay)) if v is not None]
        if a.peer_loss != spec_bridge.DEFAULT_LOSS:
            chosen.append("--peer-loss")
        if chosen:
            ap.error(f"{', '.join(chosen)}: speculators' settings; SpecForge {bridge.SPECFORGE_VERSION} runs its own "
                     f"recipe (pass --peer speculators to choose them)")
    elif a.peer_precision not in ("auto", *spec_bridge.PRECISIONS):
        ap.error(f"--peer-precision {a.peer_precision}: speculators keeps fp32 master weights; choose from "
                 f"auto, {', '.join(spec_bridge.PRECISIONS)}")
    return a


def main() -> None:
    a = parse_args()
    from eagle3.core.logs import setup_logging

    setup_logging(logging.WARNING)
    # Absolute paths: the stages run from the repository root, the bench from anywhere.
    a.config = a.config.resolve()
    y = load_yaml(a.config)
    base = WorkDir((a.work_dir or Path(y["work_dir"])).resolve())
    target = a.target_model or y["target_model"]
    target = str(Path(target).resolve()) if Path(target).exists() else target  # else a hub id
    missing = [WorkDir.script(s) for s in ("prepare", "extract", "vocab") if not base.manifest(s).is_file()]
    if missing:
        raise SystemExit(f"{base.root} lacks the output of {', '.join(missing)}: run stages 00-03 there first "
                         f"(bash scripts/demo.sh does for the demo), or pass --work-dir.")
    out = (a.out or base.root / "bench_quality").resolve()
    flags = {"max_steps": a.steps, "batch_tokens": a.batch_tokens, "ttt_steps": a.ttt_steps,
             "learning_rate": a.learning_rate, "warmup_steps": a.warmup_steps, "seed": a.seed}
    # One budget for both: the config's train section with these flags over it.
    cfg = build_config(TrainConfig, "train", a.config, {**flags, "work_dir": str(out / a.peer),
                                                        "target_model": target, "device": "cpu"},
                       sections=STAGE_CONFIGS)
    if a.peer == "specforge" and cfg.max_steps is not None and cfg.warmup_steps >= cfg.max_steps:
        raise SystemExit(f"warmup of {cfg.warmup_steps} steps in a run of {cfg.max_steps}: SpecForge's schedule "
                         f"needs steps after its warmup (lr_scheduler.py divides by their count); pass "
                         f"--warmup-steps below --steps.")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if a.peer == "specforge":
        version, env = bridge.ensure_specforge(a.specforge_env), a.specforge_env
        train_peer = train_specforge
    else:
        version, env = spec_bridge.ensure_speculators(a.speculators_env), a.speculators_env
        spec_bridge.check_loss(a.peer_loss)  # before any stage runs
        train_peer = train_speculators
    name = PEER_NAMES[a.peer]
    ours_wd = scratch_work_dir(out / "ours", base)
    peer_wd = scratch_work_dir(out / a.peer, base)
    budget = [f"--{k.replace('_', '-')}={getattr(cfg, k)}" for k in BUDGET if getattr(cfg, k) is not None]
    budget.append("--device=cpu")
    our_train_args = ([f"--loss={a.loss}"] if a.loss else []) + a.train_arg
    common = ["--config", str(a.config), "--target-model", target]
    force = ["--force"] if a.force else []
    serve = ["--temperature", "0,0.7" if a.sampled else "0", "--no-baseline-untrained", "--timing-prompts", "0",
             f"--num-speculative-tokens={cfg.ttt_steps}"]

    say(f"bench_quality: base {base.root}, target {target}, out {out}, {name} {version} from {env}")
    trainer = make_trainer(cfg)
    plan = plan_figures(trainer)
    del trainer
    say("ours:")
    run_stage("train", ours_wd, common, budget + our_train_args + force, logs, "ours")
    run_stage("export", ours_wd, common, force, logs, "ours")
    ours = our_figures(ours_wd, plan)
    precision = peer_precision(a.peer_precision)
    say(f"{name} ({precision}):")
    peer = train_peer(cfg, a, precision, peer_wd, a.force)
    run_stage("export", peer_wd, common, ["--checkpoint", str(peer_wd.root / f"{a.peer}_checkpoint.pt")],
              logs, a.peer)
    say("served:")
    run_stage("evaluate", ours_wd, common, serve + force, logs, "ours")
    run_stage("evaluate", peer_wd, common, serve + force, logs, a.peer)
    served = {"ours": served_rows(ours_wd), "peer": served_rows(peer_wd)}

    meta = {"peer": a.peer, "peer_version": version, "work_dir": str(base.root), "our_precision": our_precision(cfg),
            "our_train_args": our_train_args,
            "peer_precision": {"autocast": "bf16 autocast, fp32 weights", "fp32": "fp32",
                               "bf16": "bf16 weights (SpecForge's default torch_dtype)"}[precision]}
    paired = {row["temperature"]: paired_interval(per_prompt(ours_wd.root, row["temperature"]),
                                                  per_prompt(peer_wd.root, row["temperature"]))
              for row in served["ours"]}
    lines = report(cfg, plan, ours, peer, served, meta, paired)
    say()
    say("\n".join(lines))
    (out / "bench_quality.json").write_text(json.dumps(
        {"meta": meta, "budget": {k: getattr(cfg, k) for k in BUDGET},
         "plan": {k: v for k, v in plan.items() if k != "tokens"}, "ours": ours,
         a.peer: {k: v for k, v in peer.items() if k not in ("step_s", "teacher_s")},
         "served": {"ours": served["ours"], a.peer: served["peer"]},
         "paired_difference_ci95": {str(t): v for t, v in paired.items()}, "report": lines}, indent=1, default=str))


if __name__ == "__main__":
    main()

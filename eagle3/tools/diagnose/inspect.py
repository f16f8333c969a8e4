"""`diagnose inspect DIR [--target-config PATH_OR_DIR]`: what vLLM and SGLang will do with a drafter folder.

Reads any drafter folder (ours, or a published one such as an SGLang-format drafter)
through eagle3/serving/drafter_io.py `read_drafter_dir` and checks it with
eagle3/serving/drafter_check.py against the engines' rules: tensor names and shapes, d2t sanity, the layers each
engine (and each of vLLM's two model runners) captures, context length and
tie_word_embeddings against a target. It names the drafter's shape (eagle3/drafter/shape.py:
eagle3, or eagle3.1 with its `fc_norm` and `norm_output`) and the first engine releases that
serve it. Exit status 1 when anything would fail or silently misbehave in an engine.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3.drafter.shape import shape_name
from eagle3.serving.drafter_io import drafter_config_from_hf_config, normalise_names, read_drafter_dir
from eagle3.serving.drafter_check import TargetFacts, check_drafter, d2t_summary, errors
from eagle3.serving.engine_rules import (RULES, SHAPE_FIRST_VERSIONS, captured_layers, implied_head_dim, intended_layers,
                                         rules_for, sglang_name, vllm_name)
from eagle3.target.info import read_target_info

NAME = "inspect"


def inspect_drafter(path: Path | str, target_config: str | None = None) -> dict[str, Any]:
    """Everything `inspect` reports, as a JSON-able dict (key "ok": no errors)."""
    files = read_drafter_dir(path)
    cfg, tensors = files.config, files.tensors
    target = None
    if target_config is not None:

        target = TargetFacts.from_info(read_target_info(target_config))
    findings = check_drafter(cfg, tensors, target, pipeline_format=False)
    N = target.num_layers if target else None
    layers, where = intended_layers(cfg, target.family if target else None)
    canon, _ = normalise_names(tensors)
    d2t = canon.get("d2t")
    # the shape as this pipeline reads it (the legacy `use_aux_norm` counts as fc_norm, as SGLang reads it)
    switches = drafter_config_from_hf_config(cfg, canon) if "hidden_size" in cfg else {}
    fc_norm, norm_output = bool(switches.get("fc_norm")), bool(switches.get("norm_output"))
    shape = shape_name(fc_norm, norm_output)
    return {
        "path": str(files.path),
        "weight_files": [p.name for p in files.weight_files],
        "config": {k: cfg.get(k) for k in (
            "architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size",
            "target_hidden_size", "max_position_embeddings", "tie_word_embeddings", "torch_dtype")},
        "head_dim_used": implied_head_dim(cfg),
        "shape": {"name": shape, "fc_norm": fc_norm, "norm_output": norm_output,
                  "first_versions": SHAPE_FIRST_VERSIONS.get(shape)},
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "vllm": vllm_name(n)[0], "sglang": sglang_name(n)[0]} for n, t in tensors.items()],
        "d2t": d2t_summary(d2t, cfg.get("vocab_size")) if d2t is not None else None,
        "layers": {
            "trained": layers, "from": where,
            "config_top_level": cfg.get("eagle_aux_hidden_state_layer_ids"),
            "config_nested": (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if isinstance(cfg.get("eagle_config"), dict) else None,
            "captured": {rule: captured_layers(rule, cfg, N) for rule in rules_for(target.family if target else None)},
        },
        "target": asdict(target) if target else None,
        "findings": [asdict(f) for f in findings],
        "errors": len(errors(findings)),
        "ok": not errors(findings),
    }


def format_inspect(report: dict[str, Any]) -> str:
    c = report["config"]
    out = [f"drafter {report['path']}  ({', '.join(report['weight_files'])})", ""]
    out.append(f"config: {c['architectures']} model_type={c['model_type']} layers={c['num_hidden_layers']} "
               f"hidden={c['hidden_size']} heads={c['num_attention_heads']}/{c['num_key_value_heads']} "
               f"head_dim={c['head_dim'] if c['head_dim'] is not None else 'absent -> ' + str(report['head_dim_used'])} "
               f"intermediate={c['intermediate_size']}")
    out.append(f"        vocab={c['vocab_size']} draft_vocab={c['draft_vocab_size']} "
               f"target_hidden={c['target_hidden_size']} max_position_embeddings={c['max_position_embeddings']} "
               f"tie_word_embeddings={c['tie_word_embeddings']} dtype={c['torch_dtype']}")
    sh = report["shape"]
    served = sh["first_versions"]
    out.append(f"shape:  {sh['name']} (fc_norm={sh['fc_norm']} norm_output={sh['norm_output']})"
               + (f"; served by vLLM >= {served['vllm']}, SGLang >= {served['sglang']}" if served else ""))
    out += ["", f"{'tensor':44s} {'shape':>16s} {'dtype':9s} {'vLLM':7s} SGLang"]
    for t in report["tensors"]:
        out.append(f"{t['name']:44s} {str(t['shape']):>16s} {t['dtype']:9s} {t['vllm']:7s} {t['sglang']}")
    d = report["d2t"]
    out.append("")
    if d:
        out.append(f"d2t: {d['size']} ids, {d['dtype']}, "
                   f"target ids {d.get('min_target_id')}..{d.get('max_target_id')}, "
                   f"ascending={d['ascending']} duplicates={d['duplicates']} out_of_range={d['out_of_range']}")
    else:
        out.append("d2t: absent")
    L = report["layers"]
    out += ["", f"aux layers: trained on {L['trained']} ({L['from']}); config top-level {L['config_top_level']}, "
                f"eagle_config {L['config_nested']}"]
    width = max((len(RULES[rule].split(":")[0]) for rule in L["captured"]), default=0)
    for rule, got in L["captured"].items():
        mark = "" if got is None or got == L["trained"] or L["trained"] is None else "   <-- differs"
        label = RULES[rule].split(":")[0]
        out.append(f"  {label:{width}s} captures {got if got is not None else '[2, N//2, N-3] of the target'}{mark}")
    if report["target"]:
        t = report["target"]
        out.append(f"target {t['source']}: {t['family']} family, {t['num_layers']} layers, hidden {t['hidden_size']}, "
                   f"vocab {t['vocab_size']}, context {t['max_position_embeddings']}")
    out.append("")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(report["findings"], key=lambda f: order[f["level"]]):
        out.append(f"{f['level'].upper():7s} [{f['engine']}] {f['topic']}: {f['message']}")
    out += ["", "OK: both engines load this drafter as trained" if report["ok"]
            else f"FAIL: {report['errors']} problem(s) that fail or silently misbehave in an engine"]
    return "\n".join(out)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="check a drafter folder against vLLM's and SGLang's rules")
    p.add_argument("dir", help="drafter folder (config.json + model.safetensors)")
    p.add_argument("--target-config", help="the target's model folder or config.json (or hub id)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = inspect_drafter(args.dir, args.target_config)
    return r, format_inspect(r), (0 if r["ok"] else 1)

"""The drafter folder format: the one module that reads and writes drafter folders.

A drafter folder (docs/CONVENTIONS.md §6) is

    config.json         LlamaForCausalLMEagle3 config (see `hf_config_from_drafter_config`)
    model.safetensors   unprefixed tensors: fc.weight, midlayer.*, norm.weight, lm_head.weight,
                        d2t (int64), t2d (bool); embed_tokens.weight only when asked for;
                        fc_norm.{i}.weight for an EAGLE 3.1 drafter (config `fc_norm`,
                        `norm_output`: eagle3/serving/engine_rules.py's module doc)

`save_drafter_dir` writes one atomically (a temporary folder renamed into place) after
holding it to both engines' rules (eagle3/serving/drafter_check.py); `load_drafter_dir` reads
ours and the common published variants (names prefixed with `model.`, `layers.0.`
instead of `midlayer.`, the legacy `aux_norm_{low,mid,high}` for `fc_norm.{0,1,2}` with
its `use_aux_norm` key, sharded safetensors with an index), normalising the names
and logging what it changed. Pickled weights (`pytorch_model.bin`) are refused:
unpickling a downloaded file can run code, and the fix is a one-line conversion.

Stage 05 (eagle3/stages/s05_export/run.py) writes with it; stage 04's `--init-from` and
`python -m eagle3.tools.diagnose` read with it.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from eagle3.artifacts.atomic import atomic_path
from eagle3.core.config import dtype_name, torch_dtype
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig
from eagle3.serving.drafter_check import Finding, TargetFacts, check_drafter, errors
from eagle3.serving.engine_rules import (ARCHITECTURE, CAPTURE_TOPIC, D2T, EMBED_NAME, LEGACY_FC_NORM_KEY,
                                         LEGACY_FC_NORM_NAMES, SHAPE_KEYS, T2D, aux_layer_config, intended_layers,
                                         is_known_name, mla_drafter_reason)

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLED_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin", "model.pt", "model.pth")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A weight dtype: a torch dtype, or a name of eagle3/core/config.py's table (`bf16` or `bfloat16`)."""
    return dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)


def _dtype_text(dtype: str | torch.dtype) -> str:
    """The config.json spelling ('bfloat16') of a weight dtype."""
    return dtype_name(str(resolve_dtype(dtype)).removeprefix("torch."))


# --------------------------------------------------------------------------- config mapping

def hf_config_from_drafter_config(drafter_config: Mapping[str, Any] | Any, aux_layers: list[int], *,
                                  max_position_embeddings: int | None = None,
                                  dtype: str | torch.dtype = "bfloat16") -> dict[str, Any]:
    """The engines' config.json for a drafter (a `DrafterConfig` or its `to_dict()`).

    `aux_layers`: convention 1 ids the drafter was trained on, written for both engines
    by `engine_rules.aux_layer_config`. `max_position_embeddings`: the target's; the
    written value is never smaller (SGLang refuses a shorter draft context).
    """
    d = dict(drafter_config.to_dict() if hasattr(drafter_config, "to_dict") else drafter_config)
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                           "intermediate_size", "draft_vocab_size", "target_vocab_size",
                           "max_position_embeddings") if k not in d]
    if missing:
        raise PipelineError(f"drafter config lacks {missing}; it must hold DrafterConfig's fields "
                            f"(eagle3/drafter/model.py).")
    layers = [int(k) for k in aux_layers]
    n_aux = int(d.get("num_aux_layers", 3))
    if len(layers) != n_aux:
        raise PipelineError(f"the drafter fuses {n_aux} aux layers (num_aux_layers), but {len(layers)} layer ids "
                            f"{layers} were given; export with the layer ids stage 02 extracted for this training.")
    mpe = max(int(d["max_position_embeddings"]), int(max_position_embeddings or 0))
    hidden, target_hidden = int(d["hidden_size"]), int(d.get("target_hidden_size", d["hidden_size"]))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hidden,
        "intermediate_size": int(d["intermediate_size"]),
        "num_attention_heads": int(d["num_attention_heads"]),
        "num_key_value_heads": int(d["num_key_value_heads"]),
        "head_dim": int(d["head_dim"]),  # explicit: hidden/heads is not always the head size
        "hidden_act": "silu",
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
        # Legacy rope keys: transformers 5 folds them into rope_parameters, 4.x (SGLang) reads them as is.
        "rope_theta": float(d.get("rope_theta", 10000.0)),
        "max_position_embeddings": mpe,
        "vocab_size": int(d["target_vocab_size"]),
        "draft_vocab_size": int(d["draft_vocab_size"]),
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_text(dtype),
    }
    if d.get("rope_scaling"):
        rs = dict(d["rope_scaling"])
        # "rope_type" is the key vLLM's get_rope and transformers 5 read; Kimi's config says "type"
        rs.setdefault("rope_type", rs.get("type"))
        cfg["rope_scaling"] = rs
    if target_hidden != hidden:
        cfg["target_hidden_size"] = target_hidden
    # EAGLE 3.1's switches, written only when on: a plain EAGLE-3 config stays byte for byte
    # what it was (engines read an absent key as false).
    cfg.update({key: True for key in SHAPE_KEYS if d.get(key)})
    cfg.update(aux_layer_config(layers))
    return cfg


def drafter_config_from_hf_config(hf: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None,
                                  source: str = "config.json") -> dict[str, Any]:
    """DrafterConfig fields (eagle3/drafter/model.py) from an engine config.json.

    Sizes the config leaves implicit are taken as the engines take them (head_dim =
    hidden/heads, draft vocab = vocab), except where the tensors say otherwise
    (q_proj rows, fc width), which win because they are what was trained.
    """

    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in hf:
            raise PipelineError(f"{source} lacks {key!r}; is this an EAGLE-3 drafter config?")
    tensors = tensors or {}
    H, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    q = tensors.get("midlayer.self_attn.q_proj.weight")
    if head_dim is None:
        head_dim = q.shape[0] // nh if q is not None else H // nh
    target_hidden = int(hf.get("target_hidden_size") or H)
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] % target_hidden == 0:
        num_aux = fc.shape[1] // target_hidden
    else:
        layers, _ = intended_layers(hf)
        num_aux = int(hf.get("num_aux_hidden_states") or (len(layers) if layers else 3))
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None  # transformers 5 writes the plain rope as a "default" scaling entry
    if rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
    out = {
        "hidden_size": H,
        "num_attention_heads": nh,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or nh),
        "head_dim": int(head_dim),
        "intermediate_size": int(hf["intermediate_size"]),
        "target_hidden_size": target_hidden,
        "draft_vocab_size": int(hf.get("draft_vocab_size") or hf["vocab_size"]),
        "target_vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings") or 2048),
        "num_aux_layers": int(num_aux),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # EAGLE 3.1; the legacy spelling of fc_norm is `use_aux_norm` (SGLang reads both)
        "fc_norm": bool(hf.get("fc_norm") or hf.get(LEGACY_FC_NORM_KEY)),
        "norm_output": bool(hf.get("norm_output")),
    }
    names = {f.name for f in fields(DrafterConfig)}
    return {k: v for k, v in out.items() if k in names}


# --------------------------------------------------------------------------- reading

@dataclass
class DrafterFiles:
    """A drafter folder as stored: config dict and tensors under their on-disk names."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    weight_files: list[Path]


def _convert_hint(path: Path, name: str) -> str:
    src, dst = path / name, path / WEIGHTS_NAME
    return (f"convert it once (torch.load with weights_only=True refuses code): python -c \"import torch; "
            f"from safetensors.torch import save_file; sd = torch.load('{src}', weights_only=True); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{dst}', metadata={{'format': 'pt'}})\"")


def read_drafter_dir(path: Path | str) -> DrafterFiles:
    """Read config.json and the safetensors weights of a drafter folder, names untouched."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise PipelineError(f"{path} is not a folder; pass a drafter folder holding {CONFIG_NAME} and "
                            f"{WEIGHTS_NAME} (e.g. WORK/05_export).")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise PipelineError(f"{path} has no {CONFIG_NAME}; a drafter folder holds {CONFIG_NAME} + {WEIGHTS_NAME}.")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{cfg_file} is not valid JSON ({e}).") from e
    if not isinstance(config, dict):
        raise PipelineError(f"{cfg_file} must hold a JSON object.")

    if (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise PipelineError(f"{path / INDEX_NAME} is not a safetensors index ({e}).") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise PipelineError(f"{path / INDEX_NAME} names {[f.name for f in absent]}, which are missing; "
                                f"download the whole folder.")
    else:
        others = sorted(path.glob("*.safetensors"))
        pickled = [n for n in PICKLED_NAMES if (path / n).is_file()]
        if len(others) == 1:
            files = others
            log.info("%s: reading weights from %s (no %s)", path, others[0].name, WEIGHTS_NAME)
        elif pickled:
            raise PipelineError(f"{path} holds pickled weights ({pickled[0]}) and no {WEIGHTS_NAME}; pickles are "
                                f"not read here because loading one can run arbitrary code. "
                                + _convert_hint(path, pickled[0]))
        else:
            raise PipelineError(f"{path} has no {WEIGHTS_NAME} (nor {INDEX_NAME}); found "
                                f"{sorted(p.name for p in path.iterdir())}.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(f)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise PipelineError(f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); "
                                f"download or export it again.") from e
        dup = set(part) & set(tensors)
        if dup:
            raise PipelineError(f"{f} repeats tensors {sorted(dup)[:5]} of another shard.")
        tensors.update(part)
    return DrafterFiles(path, config, tensors, files)


def canonical_name(raw: str) -> str:
    """Convention 6's name for a tensor name of a published variant."""
    name = raw
    for prefix in ("module.", "_orig_mod.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    if name == "draft_id_to_target_id":
        name = D2T
    return LEGACY_FC_NORM_NAMES.get(name, name)


def normalise_names(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rename published variants to convention 6; return (tensors, {old: new} for those renamed)."""
    out: dict[str, torch.Tensor] = {}
    renamed: dict[str, str] = {}
    for raw, t in tensors.items():
        name = canonical_name(raw)
        if name in out:
            raise PipelineError(f"tensors {raw!r} and another both map to {name!r}; the folder holds two "
                                f"copies of one weight.")
        if name != raw:
            renamed[raw] = name
        out[name] = t
    return out, renamed


def load_drafter_dir(path: Path | str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, tensors under convention 6 names) of a drafter folder.

    Published variants are normalised (`model.` prefix, `layers.0.` for `midlayer.`)
    and the renaming is logged; tensors this format does not know are dropped with a
    warning. A multi-layer drafter is refused (this pipeline's model has one layer).
    """
    files = read_drafter_dir(path)
    mla = mla_drafter_reason(files.config, files.tensors)
    if mla:
        raise PipelineError(f"{files.path} is an MLA-attention drafter ({mla}); this pipeline trains and loads "
                            f"Llama-layer EAGLE-3 drafters ({ARCHITECTURE}) only: start from one of those "
                            f"(e.g. a K2.5 drafter with q/k/v_proj) or from scratch (no --init-from).")
    nl = files.config.get("num_hidden_layers", 1)
    if nl != 1:
        raise PipelineError(f"{files.path / CONFIG_NAME}: num_hidden_layers = {nl}; this pipeline's drafter has "
                            f"one decoder layer, so it cannot load this one.")
    tensors, renamed = normalise_names(files.tensors)
    if renamed:
        sample = ", ".join(f"{a} -> {b}" for a, b in list(renamed.items())[:3])
        log.warning("%s: normalised %d tensor name(s) to convention 6 (%s%s)", files.path, len(renamed), sample,
                    ", ..." if len(renamed) > 3 else "")
    unknown = sorted(n for n in tensors if not is_known_name(n))
    if unknown:
        log.warning("%s: dropping %d tensor(s) this format does not know: %s", files.path, len(unknown), unknown[:8])
        for n in unknown:
            del tensors[n]
    return files.config, tensors


# --------------------------------------------------------------------------- writing

def prepare_tensors(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                    dtype: str | torch.dtype = "bfloat16", include_embed_tokens: bool = False
                    ) -> dict[str, torch.Tensor]:
    """The tensors exactly as they will be saved: known names only, weights in `dtype`,
    d2t int64 and t2d bool, contiguous CPU copies; d2t dropped when the draft vocab is
    the whole target vocab (vLLM then has no parameter for it and refuses the file)."""
    dt = resolve_dtype(dtype)
    unknown = sorted(k for k in state_dict if not is_known_name(k))
    if unknown:
        raise PipelineError(f"state dict holds tensors no engine format knows: {unknown[:8]} (vLLM refuses unknown "
                            f"names); the drafter's state dict must use convention 6 names (eagle3/drafter/model.py).")
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name == EMBED_NAME and not include_embed_tokens:
            log.info("leaving out embed_tokens (both engines use the target's embedding)")
            continue
        if name == D2T:
            out[name] = t.detach().to("cpu", torch.int64).contiguous().clone()
        elif name == T2D:
            out[name] = t.detach().to("cpu", torch.bool).contiguous().clone()
        else:
            out[name] = t.detach().to("cpu", dt).contiguous().clone()
    if include_embed_tokens and EMBED_NAME not in out:
        raise PipelineError("include_embed_tokens is set but the state dict has no embed_tokens.weight; add the "
                            "target's embedding to it (eagle3/stages/s05_export/run.py does this from --target-model).")
    if D2T in out and int(config.get("draft_vocab_size") or 0) == int(config.get("vocab_size") or -1):
        if bool((out[D2T] == 0).all()):
            log.info("draft vocab = target vocab: leaving out the identity d2t (vLLM has no parameter for it)")
            del out[D2T]
    return out


def save_drafter_dir(out_dir: Path | str, state_dict: Mapping[str, torch.Tensor], config_dict: Mapping[str, Any],
                     *, dtype: str | torch.dtype = "bfloat16", include_embed_tokens: bool = False,
                     overwrite: bool = False, target: TargetFacts | None = None,
                     allow_engine_mismatch: bool = False) -> list[Finding]:
    """Write config.json + model.safetensors into `out_dir`, atomically.

    `config_dict`: the engine config (from `hf_config_from_drafter_config`). The folder
    is checked against both engines' rules (and `target`, when given) first and refused
    on any error; the findings (warnings, infos) are returned. `allow_engine_mismatch`
    turns "an engine rule captures other layers" from an error into a warning. An
    existing non-empty `out_dir` is replaced only with `overwrite`.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise PipelineError(f"{out_dir} exists and is not empty; choose an empty folder or pass --force to "
                            f"replace it.")
    tensors = prepare_tensors(state_dict, config_dict, dtype=dtype, include_embed_tokens=include_embed_tokens)
    findings = check_drafter(config_dict, tensors, target)
    if allow_engine_mismatch:
        findings = [Finding("warning", f.engine, f.topic, f.message)
                    if f.level == "error" and f.topic == CAPTURE_TOPIC else f for f in findings]
    bad = errors(findings)
    if bad:
        hint = ""
        if any(f.topic == CAPTURE_TOPIC for f in bad):
            hint = ("\nLayer ids starting at 2 (the default [2, N//2, N-3]) are captured alike by every engine: "
                    "re-extract (stage 02) with such ids, or pass --allow-engine-mismatch if you serve only with an "
                    "engine that reads them right.")
        raise PipelineError(f"refusing to write {out_dir}: the drafter would fail or misbehave in an engine:\n  "
                            + "\n  ".join(f.line() for f in bad) + hint)
    for f in findings:
        if f.level == "warning":
            log.warning("%s: %s", out_dir, f.line())
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(dict(config_dict), indent=2) + "\n")
    log.info("wrote drafter %s (%d tensors, %s)", out_dir, len(tensors), _dtype_text(dtype))
    return findings

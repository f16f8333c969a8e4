"""Served as trained: a drafter folder run by the engines' own classes against the drafter as trained.

The reference is this project's drafter (eagle3/drafter/model.py) holding what training
produced: a stage 04 checkpoint (`reference_from_checkpoint`), a drafter module
(`reference_from_drafter`), or, when nothing else is at hand, the folder itself as this
project reads it (`reference_from_folder`: then only the engines' reading of the folder is
checked, not the export). Its weights are rounded to the folder's dtype, as served, and every
forward runs in float32.

For each case (a folder and its requests, eagle3/tools/parity/protocol.py) the parent builds
the inputs (seeded aux states and embeddings; for steps k >= 1 the embedding of the target id
the reference proposed at step k-1), runs the reference, and hands the same inputs to one
worker process per engine for all cases at once (`run_workers`; vLLM with this python,
SGLang with `.venv-sglang`'s, eagle3/tools/parity/sglang_env.py). `compare` then judges each
engine's result against the reference:

    logits    per step, the largest |logit difference| against the reference's largest |logit|:
              an error above LOGIT_TOLERANCE (float32 rounding of two implementations stays
              below 1e-5 at small positions; rope angles rounded at position 100,000 reach
              ~1e-4, docs/results.md `parity`)
    ids       the target ids each engine proposes (its own draft -> target map) agree with the
              reference's, wherever the reference's top two logits are further apart than the
              tolerance allows either to move
and names the field behind a difference:
    weights   each tensor as the engine holds it after its own loader, exactly equal to the
              trained one (a tensor equal to another trained one is named as swapped, a
              transposed one as transposed); a tensor the loader refused, with the folder's
              and the trained shape; a trained tensor the folder lacks (the engine runs it as
              initialised), with the folder tensor that holds its values under another name
    d2t       the engine's draft -> target map against the trained one (absolute ids written
              as offsets, an identity where a mapping was trained)
    rope      the engine's cos/sin rows: their scale (yarn's mscale) and angles against training's,
              with the config.json rope keys that differ from the trained config
    layers    the target layers each engine rule captures for this config (the engines' own
              readers) against the layers the drafter was trained on, naming the key it read
    shape     the EAGLE 3.1 switches as the engine built its drafter from config.json (its count
              of `fc_norm` norms, its `norm_output`) against the trained ones, naming the key
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from eagle3.artifacts.train_outputs import read_checkpoint
from eagle3.artifacts.vocab_map import target_ids
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter, rope_attention_factor, rope_inv_freq
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.serving.drafter_io import (CONFIG_NAME, WEIGHTS_NAME, drafter_config_from_hf_config,
                                       hf_config_from_drafter_config, load_drafter_dir, read_drafter_dir,
                                       resolve_dtype)
from eagle3.serving.engine_rules import D2T, T2D, intended_layers
from eagle3.tools.parity import protocol
from eagle3.tools.parity.sglang_env import sglang_python

log = logging.getLogger(__name__)

# Largest |logit difference| an engine may show against the reference, as a share of the
# reference's largest |logit| at that step (measured: docs/results.md `parity`).
LOGIT_TOLERANCE = 5e-3
# Rope rows: the cos/sin scale to this relative precision; the angle at position p to
# 1e-5 + 1e-6 p radians (float32 angles of two implementations drift apart with p).
ROPE_SCALE_TOLERANCE = 1e-4
DEFAULT_STEPS = 3
FAR_POSITION = 100_000  # "far past the trained reach": K2.5 trains at most ~16K positions


@dataclass
class Reference:
    """The drafter as trained: the reference every engine is compared with."""

    drafter: Eagle3Drafter  # float32, weights rounded to the served dtype
    aux_layers: list[int]  # convention 1 ids it was trained on
    source: str

    @property
    def config(self) -> DrafterConfig:
        return self.drafter.config

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.drafter.state_dict().items() if k not in (D2T, T2D)}


def _served(drafter: Eagle3Drafter, dtype: torch.dtype) -> Eagle3Drafter:
    """A float32 copy whose weights went through `dtype` (what the engines load from the folder)."""
    copy = Eagle3Drafter(drafter.config)
    state = {k: (v.detach().to(dtype).float() if v.is_floating_point() else v) for k, v in drafter.state_dict().items()}
    copy.load_state_dict(state)
    return copy.eval()


def reference_from_drafter(drafter: Eagle3Drafter, aux_layers: Sequence[int], dtype: str | torch.dtype = "bfloat16",
                           source: str = "drafter module") -> Reference:
    return Reference(_served(drafter, resolve_dtype(dtype)), [int(k) for k in aux_layers], source)


def reference_from_checkpoint(path: Path | str, dtype: str | torch.dtype = "bfloat16") -> Reference:
    """Stage 04's checkpoint (eagle3/artifacts/train_outputs.py `read_checkpoint`) as served in `dtype`."""
    ckpt = read_checkpoint(path)
    drafter = Eagle3Drafter(DrafterConfig.from_dict(dict(ckpt.drafter_config)))
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in ckpt.model.items()})
    return reference_from_drafter(drafter, ckpt.aux_layers, dtype, source=f"checkpoint {path}")


def reference_from_folder(folder: Path | str) -> Reference:
    """The folder as this project reads it (eagle3/serving/drafter_io.py `load_drafter_dir`)."""
    config, tensors = load_drafter_dir(folder)
    dc = DrafterConfig.from_dict(drafter_config_from_hf_config(config, tensors, str(Path(folder) / CONFIG_NAME)))
    drafter = Eagle3Drafter(dc)
    state = drafter.state_dict()
    missing = [k for k in state if k not in tensors and k not in (D2T, T2D)]
    if missing:
        raise PipelineError(f"{folder}/{WEIGHTS_NAME} lacks {missing}; export the drafter again (stage 05).")
    for name, t in tensors.items():
        if name in state and name not in (D2T, T2D):
            if t.shape != state[name].shape:
                raise PipelineError(f"{folder}/{WEIGHTS_NAME}: {name} has shape {list(t.shape)}, its config implies "
                                    f"{list(state[name].shape)}; pass --checkpoint to compare it with what was "
                                    f"trained.")
            state[name] = t.float()
    if D2T in tensors:
        ids = target_ids(tensors[D2T].long())
        t2d = tensors.get(T2D)
        if t2d is None:
            t2d = torch.zeros(dc.target_vocab_size, dtype=torch.bool)
            t2d[ids.clamp(0, dc.target_vocab_size - 1)] = True  # what d2t implies: set_vocab_mapping checks the rest
        drafter.load_state_dict(state, strict=False)
        drafter.set_vocab_mapping(tensors[D2T].long(), t2d.bool())  # refuses a d2t that is not convention 2's
    else:
        drafter.load_state_dict(state, strict=False)
    layers, _ = intended_layers(config)
    return Reference(drafter.eval(), layers or [], f"the folder itself ({folder})")


# --------------------------------------------------------------------------- cases and inputs

@dataclass
class ParityCase:
    """One drafter folder and the requests it is run on: (prefix length, position offset) each."""

    name: str
    folder: Path
    reference: Reference
    chains: list[tuple[int, int]] = field(default_factory=lambda: [(24, 0), (8, FAR_POSITION)])
    steps: int = DEFAULT_STEPS
    target_layers: int | None = None  # the target's layer count (the engines' default layers need it)
    family: str | None = None  # "llama" / "deepseek" / None: which SGLang target class applies
    seed: int = 0


def token_embedding(ids: torch.Tensor, hidden: int, seed: int) -> torch.Tensor:
    """A fixed random embedding per token id (the target's embedding is not needed): [n] -> [n, H]."""
    rows = [torch.randn(hidden, generator=torch.Generator().manual_seed(seed * 1_000_003 + int(i))) for i in ids]
    return torch.stack(rows)


def run_reference(case: ParityCase) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(inputs for the workers, the reference's results) for a case (protocol.py's names)."""
    ref, chains = case.reference, [list(c) for c in case.chains]
    c = ref.config
    g = torch.Generator().manual_seed(case.seed)
    T = sum(length for length, _ in chains)
    inputs = {"aux": torch.randn(T, c.num_aux_layers * c.target_hidden_size, generator=g),
              "embeds.0": torch.randn(T, c.hidden_size, generator=g)}
    out: dict[str, list[torch.Tensor]] = {}
    draft_to_target = ref.drafter.draft_ids()
    starts = [0] + torch.tensor([length for length, _ in chains]).cumsum(0).tolist()
    with torch.no_grad():
        for r, (length, offset) in enumerate(chains):
            rows = slice(starts[r], starts[r + 1])
            positions = (offset + torch.arange(length))[None]  # [1, L]
            cache = TTTCache()
            hidden = ref.drafter.project_aux(inputs["aux"][None, rows])  # [1, L, A*H_t] -> [1, L, H]
            embeds = inputs["embeds.0"][None, rows]  # [1, L, H]
            for k in range(case.steps):
                hidden = ref.drafter.step(embeds, hidden, cache, position_ids=positions)  # [1, L, H]
                logits = ref.drafter.compute_logits(hidden)[0]  # [L, V_d]
                proposed = draft_to_target[logits.argmax(-1)]  # [L] target ids
                keep = slice(None) if k == 0 else slice(length - 1, length)  # a chain continues from its last token
                out.setdefault(f"logits.{k}", []).append(logits[keep])
                out.setdefault(f"ids.{k}", []).append(proposed[keep])
                # every position's own chain reads its own proposal next (step k+1 at t sees only t's chain)
                embeds = token_embedding(proposed, c.hidden_size, case.seed)[None]  # [1, L, H]
                if k + 1 < case.steps:
                    inputs.setdefault(f"embeds.{k + 1}", []).append(embeds[0, length - 1:length])
    for k in range(1, case.steps):
        inputs[f"embeds.{k}"] = torch.cat(inputs[f"embeds.{k}"])  # R x [1, H] -> [R, H]
    results = {k: torch.cat(v) for k, v in out.items()}
    positions = protocol.rope_positions(chains, case.steps)
    cos, sin = reference_rope(c, positions)
    results["rope"] = torch.cat([cos, sin], dim=-1)  # [P, D]: the engines' cos|sin layout
    return inputs, results


def reference_rope(config: DrafterConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training's cos and sin at `positions` (eagle3/drafter/model.py), half width each: [P, D/2] x 2."""
    freqs = positions.float()[:, None] * rope_inv_freq(config)  # [P] -> [P, D/2]
    scale = rope_attention_factor(config)
    return freqs.cos() * scale, freqs.sin() * scale


# --------------------------------------------------------------------------- engines

def run_workers(cases: Sequence[ParityCase], engines: Sequence[str], inputs: dict[str, dict[str, torch.Tensor]],
                work: Path, sglang: str | None = None) -> dict[str, dict[str, tuple[dict, dict]]]:
    """Every case through each engine, one worker process per engine: {engine: {case: (tensors, facts)}}."""
    from safetensors.torch import save_file

    work.mkdir(parents=True, exist_ok=True)
    for case in cases:
        save_file({k: v.contiguous() for k, v in inputs[case.name].items()},
                  str(work / f"{case.name}.inputs.safetensors"))
    results: dict[str, dict[str, tuple[dict, dict]]] = {}
    for engine in engines:
        request = {"engine": engine, "cases": [{
            "name": case.name, "folder": str(Path(case.folder).resolve()),
            "inputs": str(work / f"{case.name}.inputs.safetensors"), "out": str(work / f"{case.name}.{engine}"),
            "chains": [list(ch) for ch in case.chains], "steps": case.steps,
            "target_layers": case.target_layers or _layers_for_defaults(case.reference.aux_layers)}
            for case in cases]}
        run_worker(engine, request, work, sglang)
        results[engine] = {case.name: protocol.read_result(work / f"{case.name}.{engine}") for case in cases}
    return results


def run_worker(engine: str, request: dict[str, Any], work: Path, sglang: str | None = None,
               timeout: float = 1800) -> None:
    """One engine's worker process over a whole request (eagle3/tools/parity/worker.py); refuses
    with the worker's own words when the engine cannot be brought up."""
    python = sys.executable if engine == "vllm" else sglang_python(sglang)
    path = work / f"{engine}.request.json"
    protocol.write_json(path, request)
    root = Path(__file__).resolve().parents[3]
    n = len(request.get("cases", [])) + len(request.get("captures", []))
    log.info("running %d job(s) through %s's own classes (%s)", n, engine, python)
    proc = subprocess.run([python, "-m", "eagle3.tools.parity.worker", str(path)], cwd=root, capture_output=True,
                          text=True, timeout=timeout, env=_worker_env(root))
    if proc.returncode != 0:
        raise PipelineError(f"the {engine} worker failed (exit {proc.returncode}, {python}):\n{proc.stderr[-3000:]}"
                            + (_sglang_hint() if engine == "sglang" else ""))


def _worker_env(root: Path) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _sglang_hint() -> str:
    return "\nSGLang's environment is made by `bash scripts/setup_cpu.sh` (.venv-sglang, docs/OPERATIONS.md)."


def _layers_for_defaults(layers: Sequence[int]) -> int:
    """A target layer count under which the trained layers are valid ids (only the engines'
    defaults depend on it; pass the target's to judge those)."""
    return max([*layers, 3]) + 3


# --------------------------------------------------------------------------- judging

def _finding(level: str, topic: str, message: str, field_name: str | None = None) -> dict[str, Any]:
    return {"level": level, "topic": topic, "field": field_name, "message": message}


def _in_folder(name: str, folder: dict[str, torch.Tensor]) -> bool:
    return name in folder or f"model.{name}" in folder  # unprefixed (ours, SpecForge) or prefixed (NeMo)


def _renamed_as(want: torch.Tensor, folder: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> str | None:
    """The folder tensor that holds a trained tensor's values under a name no trained tensor has
    (an export that renamed it), or None."""
    for other, t in folder.items():
        if other.removeprefix("model.") in trained or not t.is_floating_point() or t.shape != want.shape:
            continue
        if torch.equal(t.float(), want):
            return other
    return None


def _missing_from_folder(name: str, want: torch.Tensor, folder: dict[str, torch.Tensor],
                         trained: dict[str, torch.Tensor], what_the_engine_did: str) -> dict[str, Any]:
    renamed = _renamed_as(want, folder, trained)
    fix = (f"its trained values are in the folder as {renamed}, which {what_the_engine_did}: write them as {name}"
           if renamed else f"export every trained tensor (stage 05)")
    return _finding("error", "weights", f"the folder has no {name}, which was trained ({list(want.shape)}): {fix}",
                    name)


def weight_findings(reference: Reference, held: dict[str, torch.Tensor], folder: dict[str, torch.Tensor]
                    ) -> list[dict[str, Any]]:
    """Each tensor as the engine holds it against the trained one, naming what differs
    (`folder`: the drafter folder's tensors under their names in the file)."""
    out = []
    trained = reference.weights()
    for name, want in trained.items():
        got = held.get(name)
        if got is None:
            out.append(_finding("error", "weights", f"the engine holds no {name} (the folder has "
                                f"{'it' if _in_folder(name, folder) else 'none'})", name))
            continue
        if got.shape == want.shape and torch.equal(got, want):
            continue
        if not _in_folder(name, folder):  # the engine keeps the value its constructor gave (an RMSNorm's ones)
            out.append(_missing_from_folder(name, want, folder, trained, "the engine does not read"))
            continue
        other = next((n for n, t in trained.items()
                      if n != name and t.shape == got.shape and torch.equal(t, got)), None)
        if other is not None:
            out.append(_finding("error", "weights", f"{name} as the engine holds it is the trained {other}: the folder "
                                f"has the two swapped (write each tensor under its own name)", name))
        elif got.shape == want.T.shape and torch.equal(got, want.T):
            out.append(_finding("error", "weights", f"{name} is the trained one transposed ({list(got.shape)}, trained "
                                f"{list(want.shape)}): write weight[out, in] as torch.nn.Linear holds it", name))
        else:
            diff = (got - want).abs().max().item() if got.shape == want.shape else math.inf
            out.append(_finding("error", "weights", f"{name} differs from the trained tensor (shape {list(got.shape)} "
                                f"vs {list(want.shape)}, max |diff| {diff:.3g})", name))
    return out


def mapping_findings(reference: Reference, engine_ids: torch.Tensor) -> list[dict[str, Any]]:
    """The engine's draft -> target map against the trained one (docs/CONVENTIONS.md §2)."""
    want = reference.drafter.draft_ids()
    if engine_ids.shape == want.shape and torch.equal(engine_ids.long(), want):
        return []
    V_d = want.shape[0]
    base = torch.arange(V_d)
    if engine_ids.shape == want.shape and torch.equal(engine_ids.long(), want + base):
        why = ("d2t holds absolute target ids (d2t[i] = target id): both engines add i (target = i + d2t[i]); "
               "write offsets, d2t[i] = target_id[i] - i")
    elif engine_ids.shape == want.shape and torch.equal(engine_ids.long(), base):
        why = "the engine maps draft id i to target id i: the folder has no d2t, but a mapping was trained"
    else:
        n = int((engine_ids.long() != want).sum()) if engine_ids.shape == want.shape else V_d
        why = f"{n} of {V_d} draft ids map to other target ids than trained (d2t of another vocabulary?)"
    return [_finding("error", "d2t", why, D2T)]


def rope_findings(reference: Reference, ours: torch.Tensor, engine: torch.Tensor, positions: torch.Tensor,
                  folder_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's cos/sin rows against training's: scale (yarn mscale) and angles."""
    D2 = ours.shape[-1] // 2
    if engine.shape != ours.shape:
        return [_finding("error", "rope", f"the engine's rope rows are {list(engine.shape)}, training's "
                         f"{list(ours.shape)}: other head_dim or partial rotary", "head_dim")]
    scale_engine, scale_ours = rope_scale(engine), rope_scale(ours)
    angle = torch.atan2(engine[:, D2:], engine[:, :D2]) - torch.atan2(ours[:, D2:], ours[:, :D2])
    angle = torch.remainder(angle + math.pi, 2 * math.pi) - math.pi  # wrapped to [-pi, pi)
    allowed = 1e-5 + 1e-6 * positions.float()[:, None]
    out = []
    keys = _rope_key_differences(reference, folder_config)
    if abs(scale_engine - scale_ours) > ROPE_SCALE_TOLERANCE * scale_ours:
        out.append(_finding("error", "rope", f"the engine scales cos/sin by {scale_engine:.4f}, training by "
                            f"{scale_ours:.4f} (every attention score {(scale_engine / scale_ours) ** 2:.4f}x "
                            f"sharper){keys}", "rope_scaling"))
    bad = (angle.abs() > allowed)
    if bool(bad.any()):
        worst = int(bad.float().sum(dim=1).argmax())
        out.append(_finding("error", "rope", f"the engine's rope angles differ from training's at position "
                            f"{int(positions[worst])} (max {angle.abs().max().item():.3g} rad){keys}",
                            "rope_theta / rope_scaling"))
    return out


def _rope_key_differences(reference: Reference, folder_config: dict[str, Any]) -> str:
    """The rope keys of config.json that differ from the trained config, as a clause."""
    trained = hf_config_from_drafter_config(reference.config, reference.aux_layers)
    parts = []
    if float(folder_config.get("rope_theta") or 0) != float(trained.get("rope_theta") or 0):
        parts.append(f"rope_theta = {folder_config.get('rope_theta')}, trained {trained.get('rope_theta')}")
    want, got = trained.get("rope_scaling") or {}, folder_config.get("rope_scaling") or {}
    missing = sorted(k for k in want if k not in got)
    extra = sorted(k for k in got if k not in want)
    changed = sorted(k for k in want if k in got and got[k] != want[k])
    if missing:
        trained_values = ", ".join(f"{k}={want[k]}" for k in missing)
        parts.append(f"rope_scaling lacks {', '.join(missing)} (trained {trained_values})")
    if extra:
        parts.append(f"rope_scaling has {', '.join(extra)}, which training did not")
    if changed:
        parts.append("rope_scaling " + ", ".join(f"{k} = {got[k]}, trained {want[k]}" for k in changed))
    return (": config.json " + "; ".join(parts)) if parts else ""


LAYER_KEYS = {"vllm": "eagle_aux_hidden_state_layer_ids (top-level; vLLM's V1 runner falls back to the nested ids)",
              "vllm-v2": "eagle_aux_hidden_state_layer_ids (top-level)",
              "sglang": "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang adds 1)",
              "sglang-deepseek": "eagle_config.eagle_aux_hidden_state_layer_ids (+1 only when the first id is 1)"}


def layer_findings(reference: Reference, captured: dict[str, list[int]], family: str | None,
                   folder_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers each engine rule captures (the engines' own readers) against the trained ones."""
    out = []
    for rule, got in captured.items():
        if rule == "sglang-deepseek" and family == "llama" or rule == "sglang" and family == "deepseek":
            continue
        if list(got) == list(reference.aux_layers):
            continue
        key = LAYER_KEYS[rule]
        top = folder_config.get("eagle_aux_hidden_state_layer_ids")
        nested = (folder_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        out.append(_finding("error", "layers", f"{rule} captures target layers {list(got)}, the drafter was trained "
                            f"on {reference.aux_layers}: it reads {key}; config.json has top-level {top}, nested "
                            f"{nested} (write top-level {reference.aux_layers}, nested "
                            f"{[k - 1 for k in reference.aux_layers]})", key.split(" ")[0]))
    return out


def load_findings(reference: Reference, error: dict[str, Any], folder: dict[str, torch.Tensor]
                  ) -> list[dict[str, Any]]:
    """The engine refused the folder: its message, each tensor it refused with both shapes, and
    (when its weight loader refused) each trained tensor the folder lacks."""
    trained = reference.weights()
    folder_shapes = {k: list(v.shape) for k, v in folder.items()}
    where = {"config": "config reader", "load_weights": "weight loader", "forward": "forward"}[error["where"]]
    out = [_finding("error", "load" if error["where"] != "forward" else "forward",
                    f"the engine's {where} raised {error['message'][:300]}")]
    for name, message in (error.get("tensors") or {}).items():
        want = trained.get(name)
        shape = folder_shapes.get(name)
        hint = ""
        if want is not None and shape is not None and list(want.shape[::-1]) == shape and list(want.shape) != shape:
            hint = f": {name} is the trained one transposed ([{', '.join(map(str, shape))}], trained " \
                   f"{list(want.shape)}); write weight[out, in] as torch.nn.Linear holds it"
        elif want is not None and shape is not None:
            hint = f": the folder's shape {shape}, trained {list(want.shape)}"
        out.append(_finding("error", "weights", f"its loader refused {name} ({message[:160]}){hint}", name))
    if error["where"] == "load_weights":
        out += [_missing_from_folder(name, want, folder, trained, "the loader refused")
                for name, want in trained.items() if not _in_folder(name, folder)]
    return out


def shape_findings(reference: Reference, built: dict[str, Any], folder_config: dict[str, Any]
                   ) -> list[dict[str, Any]]:
    """The EAGLE 3.1 switches of the drafter as the engine built it from config.json (`built`:
    {"fc_norm": its count of per-aux-layer norms, "norm_output": bool}) against the trained ones."""
    c = reference.config
    out = []
    want_norms = c.num_aux_layers if c.fc_norm else 0
    got_norms = int(built.get("fc_norm") or 0)
    written = f"config.json has fc_norm = {json.dumps(folder_config.get('fc_norm'))}"
    if got_norms != want_norms and not want_norms:
        out.append(_finding("error", "shape", f"the engine norms each aux layer before fc ({written}); the drafter "
                            f"was trained without fc_norm: drop the key", "fc_norm"))
    elif got_norms != want_norms and not got_norms:
        out.append(_finding("error", "shape", f"the engine builds no fc_norm ({written}); the drafter was trained "
                            f"with one RMSNorm per aux layer before fc: write \"fc_norm\": true", "fc_norm"))
    elif got_norms != want_norms:
        out.append(_finding("error", "shape", f"the engine builds {got_norms} fc_norm norms, the drafter was trained "
                            f"on {want_norms} aux layers: config.json's eagle_config.eagle_aux_hidden_state_layer_ids "
                            f"(or num_aux_hidden_states) sets the count", "fc_norm"))
    got_output = bool(built.get("norm_output"))
    if got_output != c.norm_output:
        fed, trained_fed = ("post-norm", "pre-norm") if got_output else ("pre-norm", "post-norm")
        fix = "drop the key" if got_output else "write \"norm_output\": true"
        out.append(_finding("error", "shape", f"the engine feeds each next draft step its {fed} output (config.json "
                            f"has norm_output = {json.dumps(folder_config.get('norm_output'))}); the drafter was "
                            f"trained on the {trained_fed} one: {fix}", "norm_output"))
    return out


def compare(case: ParityCase, ours: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], facts: dict[str, Any],
            tolerance: float = LOGIT_TOLERANCE) -> dict[str, Any]:
    """One engine's result for one case, judged against the reference (module doc)."""
    files = read_drafter_dir(case.folder)
    findings: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    if facts.get("built"):
        findings += shape_findings(case.reference, facts["built"], files.config)
    if facts.get("error"):
        findings += load_findings(case.reference, facts["error"], files.tensors)
    held = {k.removeprefix("held."): v for k, v in tensors.items() if k.startswith("held.")}
    if held:
        findings += weight_findings(case.reference, held, files.tensors)
    if "target_ids" in tensors:
        findings += mapping_findings(case.reference, tensors["target_ids"])
    if "rope" in tensors:
        positions = protocol.rope_positions([list(c) for c in case.chains], case.steps)
        findings += rope_findings(case.reference, ours["rope"], tensors["rope"], positions, files.config)
    for k in range(case.steps):
        if f"logits.{k}" not in tensors or f"ids.{k}" not in tensors:
            break
        want, got = ours[f"logits.{k}"], tensors[f"logits.{k}"].float()
        scale = max(1.0, want.abs().max().item())
        diff = (got - want).abs().max().item() if got.shape == want.shape else math.inf
        top2 = want.topk(2, dim=-1).values if want.shape[-1] > 1 else None
        margin = (top2[:, 0] - top2[:, 1]) if top2 is not None else torch.full((want.shape[0],), math.inf)
        clear = margin > 2 * tolerance * scale  # rows whose argmax no allowed difference can move
        same = tensors[f"ids.{k}"].long() == ours[f"ids.{k}"]
        steps.append({"step": k, "rows": int(want.shape[0]), "max_logit_diff": diff, "logit_scale": scale,
                      "relative": diff / scale, "ids_agree": float(same.float().mean()),
                      "ids_disagree_clear": int((~same & clear).sum())})
    if steps:
        worst = max(steps, key=lambda s: s["relative"])
        if worst["relative"] > tolerance:
            explained = bool(findings)
            findings.append(_finding("error", "logits", f"logits differ from the reference by up to "
                                     f"{worst['max_logit_diff']:.3g} at step {worst['step']} ({worst['relative']:.2e} "
                                     f"of the largest logit, tolerance {tolerance:g})"
                                     + ("" if explained else ": no weight, mapping, rope or layer difference "
                                        "explains it: the engine's forward itself differs")))
        bad_ids = sum(s["ids_disagree_clear"] for s in steps)
        if bad_ids:
            findings.append(_finding("error", "ids", f"{bad_ids} proposed target id(s) differ from the reference's "
                                     f"where its margin is clear"))
    if facts.get("captured"):
        findings += layer_findings(case.reference, facts["captured"], case.family, files.config)
    return {"steps": steps, "findings": findings, "ok": not any(f["level"] == "error" for f in findings),
            "versions": facts.get("versions"), "captured": facts.get("captured"), "built": facts.get("built"),
            "rope_scale": rope_scale(tensors["rope"]) if "rope" in tensors else None}


def rope_scale(rows: torch.Tensor) -> float:
    """The factor cos|sin rows [P, D] are scaled by (yarn's mscale; 1.0 for plain rope)."""
    half = rows.shape[-1] // 2
    return rows[:, :half].hypot(rows[:, half:]).mean().item()


def check_parity(cases: Sequence[ParityCase], engines: Sequence[str] = ("vllm", "sglang"),
                 tolerance: float = LOGIT_TOLERANCE, sglang: str | None = None,
                 work: Path | None = None) -> dict[str, Any]:
    """Every case through every engine, judged; {"cases": [...], "ok": all fine}."""
    if "sglang" in engines:
        sglang_python(sglang)  # refuses before any work when SGLang's environment is missing
    refs, inputs = {}, {}
    for case in cases:
        inputs[case.name], refs[case.name] = run_reference(case)
    with tempfile.TemporaryDirectory(prefix="eagle3-parity-") as tmp:
        results = run_workers(cases, engines, inputs, Path(work) if work else Path(tmp), sglang=sglang)
        report = []
        for case in cases:
            per_engine = {e: compare(case, refs[case.name], *results[e][case.name], tolerance=tolerance)
                          for e in engines}
            report.append({"name": case.name, "folder": str(case.folder), "reference": case.reference.source,
                           "chains": [list(c) for c in case.chains], "steps": case.steps, "engines": per_engine})
    return {"cases": report, "tolerance": tolerance, "engines": list(engines),
            "ok": all(r["engines"][e]["ok"] for r in report for e in engines)}


def format_report(report: dict[str, Any]) -> str:
    lines = []
    for case in report["cases"]:
        lines.append(f"{case['name']}: {case['folder']} against {case['reference']}")
        lines.append(f"  requests (prefix, offset) {case['chains']}, {case['steps']} chained steps")
        for engine, r in case["engines"].items():
            ver = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items() if k != "stubbed")
            steps = "  ".join(f"step {s['step']}: max |dlogit| {s['max_logit_diff']:.2e} ({s['relative']:.1e}), ids "
                              f"{100 * s['ids_agree']:.0f}%" for s in r["steps"])
            lines.append(f"  {engine} ({ver}): {'ok' if r['ok'] else 'FAIL'}  {steps or 'no forward'}")
            for f in r["findings"]:
                lines.append(f"    {f['level'].upper()} [{f['topic']}] {f['message']}")
    lines.append("")
    lines.append("OK: every engine serves the drafter as trained" if report["ok"] else
                 f"FAIL: an engine serves the drafter otherwise than trained (tolerance {report['tolerance']:g} of "
                 f"the largest logit)")
    return "\n".join(lines)

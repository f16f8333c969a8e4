"""Starting from an existing drafter (`--init-from DIR`) without scrambling its labels.

Row i of a drafter's lm_head predicts target token `i + d2t[i]` of *its own*
mapping (docs/CONVENTIONS.md §3). Loading its weights under another mapping
silently relabels almost every row (31,748 of 32,000 positions differed for the
K2 drafter against a K2.5 mapping). So a fine-tune either

- `keep`s the drafter's mapping for the whole run (stage 03's is then unused, and
  the coverage the drafter's vocabulary gets on our data is reported), or
- `remap`s: lm_head rows are permuted into stage 03's mapping; rows of tokens the
  drafter never had are initialised from the target's lm_head row of that token,
  scaled to the mean norm of the drafter's own rows (the drafter's norm output
  lives in a space trained to feed its lm_head, so a unit-free direction from the
  target plus a typical magnitude is the least surprising start).

Either way the comparison (positions differing, tokens shared, only in each) is
logged and returned for the manifest. Aux layer ids and sizes are checked first.

The drafter's shape (eagle3/drafter/shape.py) is its config.json's: an EAGLE 3.1 drafter
(`fc_norm`, `norm_output`; or the legacy spelling SGLang still reads, `use_aux_norm` with
norms named `aux_norm_{low,mid,high}`) is trained as one, and `--drafter-shape`, when given, must name
it: the norms change the network, so a drafter cannot be continued as another shape. A
config switching on a layer variant this model lacks (`norm_before_fc`, ...) is refused.

Published drafters (SpecForge's Kimi-K2/K2.5 and DeepSeek ones) often carry the
target's token embedding as `embed_tokens.weight` (or `model.embed_tokens.weight`).
This pipeline's drafter has none: it reads the target's frozen embedding, as both
engines do when serving it, so the tensor is dropped with a warning (and listed in
the report) instead of failing the load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eagle3.artifacts.vocab_map import VocabMapping, compare_mappings, d2t_from_ids, target_ids
from eagle3.core.errors import PipelineError
from eagle3.serving.drafter_io import drafter_config_from_hf_config, load_drafter_dir
from eagle3.drafter.shape import shape_name
from eagle3.serving.engine_rules import EMBED_NAME, VARIANT_KEYS, intended_layers
from eagle3.target.info import default_aux_layers

log = logging.getLogger(__name__)


@dataclass
class InitReport:
    source: str
    mode: str
    layers: list[int]
    layers_from: str
    comparison: dict
    rows_copied: int = 0
    rows_new: int = 0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"source": self.source, "vocab_mode": self.mode, "aux_layers": self.layers,
                "aux_layers_from": self.layers_from, **self.comparison,
                "rows_copied": self.rows_copied, "rows_new": self.rows_new, **self.extra}


def remap_lm_head(lm_head: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray,
                  new_rows: Callable[[np.ndarray], torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """lm_head rows for `dst_ids` (target ids, ascending) from a head over `src_ids`.

    lm_head [V_src, H] -> [V_dst, H]; a token in both keeps its trained row, the
    others come from `new_rows(target_ids) -> [n, H]`. Returns (rows, copied, new).
    """
    where = {int(t): i for i, t in enumerate(src_ids)}
    out = torch.empty(len(dst_ids), lm_head.shape[1], dtype=lm_head.dtype)  # [V_dst, H]
    src_rows = [where.get(int(t), -1) for t in dst_ids]
    have = torch.tensor([r >= 0 for r in src_rows], dtype=torch.bool)
    if have.any():
        out[have] = lm_head[torch.tensor([r for r in src_rows if r >= 0])]  # gather [n_copied, H]
    missing = dst_ids[~have.numpy()]
    if len(missing):
        out[~have] = new_rows(missing).to(lm_head.dtype)  # [n_new, H]
    return out, int(have.sum()), int(len(missing))


def scaled_target_rows(target_rows: Callable[[np.ndarray], torch.Tensor], reference: torch.Tensor):
    """new_rows for `remap_lm_head`: target lm_head directions at the drafter's typical row norm."""
    scale = reference.float().norm(dim=1).mean()

    def rows(ids: np.ndarray) -> torch.Tensor:
        w = target_rows(ids).float()  # [n, H]
        return w / w.norm(dim=1, keepdim=True).clamp_min(1e-6) * scale

    return rows


def drop_embedding(path: str | Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Remove a published drafter's copy of the target embedding; the names dropped."""
    if EMBED_NAME not in tensors:
        return []
    emb = tensors.pop(EMBED_NAME)
    log.warning("%s holds %s %s: dropped; the drafter is trained (and served) with the target's own frozen "
                "embedding, as both engines do", path, EMBED_NAME, tuple(emb.shape))
    return [EMBED_NAME]


def check_fits(path: str | Path, hf: dict, cfg: dict, *, aux_layers: list[int], num_target_layers: int,
               target_hidden: int, target_vocab: int, expected_from: str,
               target_family: str | None = None) -> tuple[list[int], str]:
    """The drafter's aux layer ids (and where they come from, read as SGLang reads them for
    the target's family), refused unless they are the store's and its target sizes are ours."""
    layers, layers_from = intended_layers(hf, target_family)
    if layers is None:
        # Both engines then capture their default [2, N//2, N-3]; a drafter published
        # without ids was trained for that default, as far as anyone can tell.
        layers = default_aux_layers(num_target_layers)
        layers_from = f"none in config.json; the engines' default for {num_target_layers} layers"
        log.warning("%s/config.json names no aux layer ids: assuming the engines' default %s", path, layers)
    if list(layers) != list(aux_layers):
        raise PipelineError(
            f"aux layer mismatch: the drafter {path} was trained on layers {layers} ({layers_from}) but the "
            f"hidden-state store has {aux_layers} ({expected_from}); rerun stage 02 with "
            f"--aux-layers {','.join(map(str, layers))}, or start from another drafter.")
    for what, theirs, ours in (("target hidden size", cfg["target_hidden_size"], target_hidden),
                               ("target vocab size", cfg["target_vocab_size"], target_vocab)):
        if theirs != ours:
            raise PipelineError(f"{what} mismatch: {theirs} ({path}/config.json) vs {ours} ({expected_from}); "
                                f"this drafter was built for another target.")
    return list(layers), layers_from


def check_shape(path: str | Path, hf: dict, cfg: dict, wanted: str | None) -> str:
    """The drafter's shape name; refused when its network is not this model's, or is not `wanted`."""
    variants = [k for k in VARIANT_KEYS if hf.get(k)]
    if variants:
        raise PipelineError(f"{path}/config.json sets {variants}: a layer variant this pipeline's drafter does not "
                            f"implement (eagle3/drafter/model.py), so its weights would run in another network; "
                            f"start from a drafter without it, or from scratch (no --init-from).")
    shape = shape_name(cfg["fc_norm"], cfg["norm_output"])
    if wanted is not None and wanted != shape:
        raise PipelineError(f"--drafter-shape {wanted}, but {path} is an {shape} drafter (config.json: fc_norm "
                            f"{cfg['fc_norm']}, norm_output {cfg['norm_output']}); its weights were trained in "
                            f"that network: pass --drafter-shape {shape} (or leave it out), or train a new "
                            f"{wanted} drafter without --init-from.")
    return shape


def apply_vocab_mode(report: InitReport, tensors: dict[str, torch.Tensor], cfg: dict, their_ids: np.ndarray,
                     our_ids: np.ndarray, target_rows: Callable[[np.ndarray], torch.Tensor]) -> np.ndarray:
    """`keep`: the drafter's own ids; `remap`: its lm_head rows moved into ours (tensors
    and cfg updated, the row counts in the report). Returns the target ids trained."""
    if report.mode == "keep":
        log.info("vocab mode 'keep' (the safe default): training with the drafter's own mapping; stage 03's "
                 "mapping is not used")
        return their_ids
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"], report.rows_copied, report.rows_new = remap_lm_head(
        head, their_ids, our_ids, scaled_target_rows(target_rows, head))
    cfg["draft_vocab_size"] = len(our_ids)
    log.info("vocab mode 'remap': %d lm_head rows permuted into stage 03's mapping, %d new rows initialised "
             "from the target's lm_head", report.rows_copied, report.rows_new)
    return our_ids


def load_initial_drafter(
    path: str | Path, *, aux_layers: list[int], num_target_layers: int, target_hidden: int, target_vocab: int,
    our_ids: np.ndarray, mode: str, target_rows: Callable[[np.ndarray], torch.Tensor],
    expected_from: str, target_family: str | None = None, shape: str | None = None,
) -> tuple[dict, dict[str, torch.Tensor], InitReport]:
    """(DrafterConfig dict, state_dict, report) of the drafter at `path`, ready for our run;
    `shape`: the --drafter-shape asked for (None: the drafter's own)."""
    hf, tensors = load_drafter_dir(path)  # names normalised: model.embed_tokens.weight -> embed_tokens.weight
    dropped = drop_embedding(path, tensors)
    cfg = drafter_config_from_hf_config(hf, tensors, source=f"{path}/config.json")
    their_shape = check_shape(path, hf, cfg, shape)
    layers, layers_from = check_fits(path, hf, cfg, aux_layers=aux_layers, num_target_layers=num_target_layers,
                                     target_hidden=target_hidden, target_vocab=target_vocab,
                                     expected_from=expected_from, target_family=target_family)

    V = cfg["target_vocab_size"]
    if "d2t" in tensors:
        their_ids = target_ids(tensors["d2t"].numpy())
    else:  # both engines then use the identity
        their_ids = np.arange(cfg["draft_vocab_size"], dtype=np.int64)
    # A full-vocabulary drafter (lightseekorg's K2.5 one: 163,840 rows, no d2t, or an identity
    # one) has a row for every token: there is no mapping to compare position by position.
    full_vocab = len(their_ids) == V and bool((their_ids == np.arange(V)).all())
    cmp = compare_mappings(VocabMapping(str(path), their_ids, V), VocabMapping("stage 03", our_ids, V))
    if full_vocab:
        log.info("init-from %s: a full-vocabulary drafter (%d lm_head rows, %s): every one of stage 03's %d tokens "
                 "has its trained row; vocab mode 'remap' keeps those %d rows, 'keep' trains all %d", path, V,
                 "identity d2t" if "d2t" in tensors else "no d2t", len(our_ids), len(our_ids), V)
    else:
        log.info("init-from %s: its d2t vs stage 03's: %d of %d positions differ, %d tokens shared, %d only in "
                 "the drafter's, %d only in ours", path, cmp["positions_differing"], cmp["positions_compared"],
                 cmp["tokens_shared"], cmp["only_in_a"], cmp["only_in_b"])
    extra = {"tensors_dropped": dropped} if dropped else {}
    extra.update(full_vocabulary=full_vocab, num_key_value_heads=cfg["num_key_value_heads"],
                 num_attention_heads=cfg["num_attention_heads"], drafter_shape=their_shape)
    report = InitReport(str(path), mode, layers, layers_from, cmp, extra=extra)

    ids = apply_vocab_mode(report, tensors, cfg, their_ids, our_ids, target_rows)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    tensors["d2t"], tensors["t2d"] = torch.from_numpy(d2t_from_ids(ids)), t2d
    return cfg, tensors, report

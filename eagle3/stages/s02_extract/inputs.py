"""What stage 02 checks before any model loads, and its reads of stage 01's splits.

Reads stage 01's manifest and `01_dataset/{train,eval}`, the target's config and tokenizer,
and the store folder's `store.json`; writes `store.json` when the folder has none, and under
--force deletes the store folder's files (never the folder). `validate` returns `Prepared`,
what every later step of the stage (whole store or windows) works from.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3.artifacts import claims, store, windows
from eagle3.artifacts.dataset import load_split as load_prepared
from eagle3.artifacts.manifest import check_same, manifest_fingerprint, read_manifest, record_of, sha256_json
from eagle3.artifacts.records import PrepareRecord
from eagle3.artifacts.workdir import SPLITS, WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.target.info import (TargetInfo, load_tokenizer, read_target_info, tokenizer_fingerprint,
                                validate_aux_layers, weights_fingerprint)

# Logged under the name these lines carried while stage 02 was one module, so the log
# lines (and whatever greps them) stay the same.
log = logging.getLogger("eagle3.stages.s02_extract.run")


@dataclass
class Prepared:
    """Everything checked before any model is loaded."""

    workdir: WorkDir
    info: TargetInfo
    aux_layers: list[int]
    params: dict
    inputs: dict
    identity: dict
    identity_hash: str
    num_samples: dict[str, int]
    max_tokens: int


def load_split(workdir: WorkDir, split: str):

    path = workdir.dataset(split)
    try:
        return load_prepared(path).with_format("numpy")
    except FileNotFoundError as e:
        raise PipelineError(f"{path} is missing although stage 01's manifest lists it; rerun "
                            f"`python {workdir.script('prepare')} --force`.") from e


def split_lengths(workdir: WorkDir, split: str) -> np.ndarray:
    return np.asarray(load_split(workdir, split)["num_tokens"], dtype=np.int64)  # [num_samples]


def validate(cfg: ExtractConfig) -> Prepared:
    workdir = WorkDir(cfg.work_dir)
    script = workdir.script("extract")
    prep = read_manifest(workdir, "prepare", needed_by=script)
    pr: PrepareRecord = record_of(prep)
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    aux = validate_aux_layers(cfg.aux_layers if cfg.aux_layers is not None else info.default_aux_layers(),
                              info.num_layers, source=f"extract.aux_layers (--aux-layers) for {cfg.target_model}")
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    fp = tokenizer_fingerprint(tok)
    check_same("tokenizer fingerprint", pr.tokenizer_fingerprint, fp,
               ours_from=f"{prep.path} (stage 01, target {pr.target_model})",
               theirs_from=f"tokenizer of {cfg.target_model}",
               fix=f"pass the target stage 01 used, or rerun `python {workdir.script('prepare')} --force` with "
                   f"--target-model {cfg.target_model}")
    if pr.vocab_size != info.vocab_size:
        raise PipelineError(f"stage 01 ({prep.path}) used vocab_size {pr.vocab_size}, "
                            f"{cfg.target_model} has {info.vocab_size}; rerun stage 01 with this target.")
    lengths = {s: split_lengths(workdir, s) for s in SPLITS}
    num_samples = {s: int(len(v)) for s, v in lengths.items()}
    if not num_samples["train"]:
        raise PipelineError(
            f"stage 02: {workdir.dataset('train')} holds 0 samples (stage 01 counted {pr.records} records, "
            f"{num_samples['eval']} held-out samples, bad records: {pr.bad_records or 'none'}); rerun "
            f"`python {workdir.script('prepare')} --force` with records that hold assistant turns and a lower "
            f"--eval-fraction.")
    max_tokens = max((int(v.max()) for v in lengths.values() if len(v)), default=1)

    params = identity_params(cfg)
    params["aux_layers"] = aux  # resolved: the default is recorded as the ids it means
    # The weights too: a retrained target with the same config must not reuse a store.
    inputs = {"prepare": manifest_fingerprint(prep), "target_config": sha256_json(info.text_config),
              "target_weights": weights_fingerprint(cfg.target_model)}
    identity = {
        "store_format": store.STORE_FORMAT, "aux_layers": aux, "hidden_size": info.hidden_size,
        "num_layers": info.num_layers, "vocab_size": info.vocab_size, **store.identity_fields(cfg.store_dtype),
        "tokenizer_fingerprint": fp, "target_model": cfg.target_model, "compute_dtype": cfg.dtype,
        "backend": cfg.backend, "samples_per_file": cfg.samples_per_file, "num_samples": num_samples,
        "inputs": inputs,
    }
    return Prepared(workdir, info, aux, params, inputs, identity, store.identity_hash(identity), num_samples, max_tokens)


def check_store_identity(prepared: Prepared, force: bool, claim: claims.Claim | None = None) -> None:
    """Refuse to mix files of two different stores in one folder. `force`: delete the store's
    files first (`delete_store_files`; `claim`: this run's claim on the folder, kept)."""
    d = prepared.workdir.store()
    path = d / store.STORE_JSON
    if force and d.exists():
        delete_store_files(d, claim)
    d.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(prepared.identity) if old.get(k) != prepared.identity.get(k))
        if diff:
            both = "; ".join(f"{k}: {old.get(k)!r} (in {path}) vs {prepared.identity.get(k)!r} (this run)" for k in diff)
            raise PipelineError(f"the store in {d} was built with other settings: {both}. Pass --force to "
                                f"delete it and start over, or rerun with its settings.")
    else:
        store.write_identity(d, prepared.identity)


def delete_store_files(store_dir: Path, claim: claims.Claim | None) -> None:
    """--force: delete what the store folder holds, never the folder itself, and nothing while
    another run holds the folder or a round folder in it (its claim, eagle3/artifacts/claims.py)."""
    rounds_dir = store_dir / windows.WINDOWS_DIR
    inside = [store_dir] + ([sub for sub in rounds_dir.iterdir() if sub.is_dir()] if rounds_dir.is_dir() else [])
    busy = [(folder, holder) for folder, holder in claims.live_claims(inside)
            if claim is None or holder.token != claim.holder.token]
    if busy:
        folder, holder = busy[0]
        raise PipelineError(f"--force would delete {store_dir}, but {claims.refusal(folder, holder)}")
    log.warning("--force: deleting the existing store's files in %s", store_dir)
    claims.empty_but_claim(store_dir, claim)

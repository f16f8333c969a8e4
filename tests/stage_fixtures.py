"""Work directories with stages 01-03 done, built once per session and copied per test."""
from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.run import extract_hidden_states
from eagle3.stages.s01_prepare.run import prepare_dataset
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s03_vocab.run import build_vocab_mapping
from eagle3.stages.s03_vocab.config import VocabConfig

ROOT = Path(__file__).resolve().parent.parent


def build_stages_123(wd: Path, target: Path, *, chats: int = 60) -> Path:
    """Stages 01-03 on the first `chats` demo chats: HF backend in float32, 32 samples per
    store file, a 128-token draft vocabulary."""
    data = wd / "chats.jsonl"
    data.write_text("\n".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:chats]) + "\n")
    prepare_dataset(PrepareConfig(work_dir=wd, target_model=str(target), data=[str(data)], max_length=256,
                                  eval_fraction=0.15, num_workers=1))
    extract_hidden_states(ExtractConfig(work_dir=wd, target_model=str(target), backend="hf",
                                        samples_per_file=32, dtype="float32"))
    build_vocab_mapping(VocabConfig(work_dir=wd, draft_vocab_size=128))
    return wd


def copy_stages(base: Path, dest: Path) -> Path:
    """A private copy of base's stages 01-03 for a test that writes (stage 04 and after)."""
    for stage in ("01_dataset", "02_hidden_states", "03_vocab"):
        shutil.copytree(base / stage, dest / stage)
    return dest


def kill_after_entries(cmd: list[str], store_dir: Path, entries: int = 2, timeout_s: float = 120) -> None:
    """Run a stage-02 command and kill -9 it once `entries` store files are complete (their
    index entries written), so a rerun has some files to keep and some to redo."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while len(list(store_dir.glob("*-0*.json"))) < entries:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

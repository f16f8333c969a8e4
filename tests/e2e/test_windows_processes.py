"""Stage 04 over windows resumed under another process count (eagle3/stages/s04_train/windows.py
`RoundSchedule.resume_step`), on the tiny Llama (HF backend of stage 02, CPU, torchrun with gloo).

One process trains rounds 0 and 1 and stops at round 2 (not extracted yet); two processes
resume. A round's steps scale with the process count, which is not part of the run's
identity: before the fix the 1-process step number was read in the 2-process schedule, where
it lies past the end of round 2, so round 2 was deleted untrained and the run ended
"complete". `save_every` is above a round's steps here: only the save forced at a round's end
writes the checkpoint that covers it.

Cost: stages 01 and 03 on 60 chats, stage 02 three times, ~20 steps on one process and a
few on two; about a minute on 2 cores.
"""
import json

import yaml
from fixtures import ROOT, run_stages, torchrun

from eagle3.artifacts import windows
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.run import extract_hidden_states
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter

BUDGET = 8_000_000  # bytes: the held-out file (~1.1 MB) and two windows of ~3.4 MB: 3 rounds


def test_a_resume_under_another_process_count_trains_every_round(tmp_path, tiny_llama):
    work = run_stages(tmp_path / "work", tiny_llama, upto="prepare", chats=60)
    run_stages(work, tiny_llama, first="vocab", upto="vocab")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "work_dir": str(work), "target_model": str(tiny_llama),
        "extract": {"backend": "hf", "samples_per_file": 8, "dtype": "float32", "disk_budget": BUDGET,
                    "windows_in_budget": 2},
        "vocab": {"draft_vocab_size": 128},
        "train": {"batch_tokens": 512, "max_seq_len": 256, "log_every": 1, "eval_every": 1000, "save_every": 1000,
                  "keep_checkpoints": 2, "ttt_steps": 2, "warmup_steps": 1, "learning_rate": 3e-3}}))
    workdir = WorkDir(work)
    wdir = workdir.store() / windows.WINDOWS_DIR
    extract = lambda: extract_hidden_states(  # noqa: E731
        build_config(ExtractConfig, "extract", config, {}, sections=STAGE_CONFIGS))

    extract()
    extract()  # rounds 0 and 1: the budget holds two
    assert windows.present_rounds(wdir) == [0, 1]
    # round 2 is not extracted yet
    assert train_drafter(build_config(TrainConfig, "train", config, {}, sections=STAGE_CONFIGS)) is None
    one = json.loads(workdir.latest_checkpoint().read_text())["step"]
    assert windows.read_progress(wdir) == {"trained_rounds": 2, "checkpoint": workdir.checkpoint(one).name, "step": one}
    assert windows.present_rounds(wdir) == []
    extract()
    assert windows.present_rounds(wdir) == [2]

    r = torchrun(2, [ROOT / "04_train_drafter.py", "--config", config, "--dist-timeout-s", "900"], 600,
                 tmp_path / "logs")
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(workdir.manifest("train").read_text())["counts"]
    assert counts["processes"] == 2
    two = counts["steps_per_round"]  # the 2-process schedule
    start, end = sum(two[:2]), sum(two)
    assert one > start, "the 1-process checkpoint's step number must not be a step of the 2-process schedule"
    # Round 2 trained on two processes, every one of its steps, then deleted; the run ends at its end.
    rows = [json.loads(line) for line in workdir.train_metrics().read_text().splitlines()]
    trained = [row["step"] for row in rows if row["split"] == "train"]
    assert trained[-(end - start):] == list(range(start + 1, end + 1)), trained
    assert json.loads(workdir.latest_checkpoint().read_text())["step"] == end
    assert windows.read_progress(wdir)["trained_rounds"] == 3 and windows.present_rounds(wdir) == []
    # The 1-process files numbered above it were superseded by the 2-process ones and pruned.
    assert max(WorkDir.checkpoint_step(p) for p in workdir.checkpoints().glob("step-*.pt")) == end
    log = workdir.log_file("04_train").read_text()
    assert f"it covers 2 round(s), so training goes on at step {start} of {end}, the start of round 2" in log
    assert "collective timeout 900 s" in log

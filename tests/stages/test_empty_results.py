"""No silent empty result: stages 00, 01 and 02 stop with one line (the input, the counts
by reason, the likely fix) when their output would hold no usable sample.

Stage 00's and 01's refusals are tested in tests/e2e/test_generate.py and tests/stages/test_prepare.py;
here stage 02's (an empty train split, a store whose every sample is NaN) and the scripts'
exit: status 2, one error line, no traceback. About 40 s on 2 cores (three script starts,
two transformers extractions on the tiny Llama).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import prepare_dataset
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.run import extract_hidden_states

ROOT = Path(__file__).resolve().parents[2]
N_CHATS = 8


def chats(path: Path) -> Path:
    path.write_text("".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines(True)[:N_CHATS]))
    return path


def extract_cfg(workdir: Path, target: Path) -> ExtractConfig:
    return ExtractConfig(work_dir=workdir, target_model=str(target), backend="hf", samples_per_file=4)


def test_stage_02_refuses_an_empty_train_split_before_loading_the_target(tmp_path, tiny_llama, monkeypatch):
    import eagle3.stages.s01_prepare.run as prepare

    # A stage-01 output with every sample held out, as a stage 01 without its own refusal wrote it.
    monkeypatch.setattr(prepare, "is_eval", lambda sid, seed, fraction: True)
    monkeypatch.setattr(prepare, "refuse_or_warn_dropped", lambda *a: None)
    workdir = tmp_path / "w"
    prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(tiny_llama), data=[str(chats(tmp_path / "c.jsonl"))],
                                  num_workers=1))
    loaded = []
    monkeypatch.setattr("eagle3.stages.s02_extract.write.load_engine", lambda *a, **k: loaded.append(1))
    with pytest.raises(PipelineError) as e:
        extract_hidden_states(extract_cfg(workdir, tiny_llama))
    msg = str(e.value)
    assert "\n" not in msg and str(WorkDir(workdir).dataset("train")) in msg and "holds 0 samples" in msg
    assert f"{N_CHATS} records, {N_CHATS} held-out samples" in msg and "--eval-fraction" in msg
    assert not loaded and not WorkDir(workdir).manifest("extract").exists()


@pytest.fixture(scope="module")
def nan_target(tiny_targets, tmp_path_factory) -> Path:
    """The tiny Llama with one NaN in layer 1's MLP: every hidden state from layer 2 on is NaN,
    as a target that overflows in its dtype gives."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan-target") / "target"
    shutil.copytree(tiny_targets["llama"], out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_stage_02_refuses_a_store_whose_every_train_sample_is_nan(tmp_path, nan_target, caplog):
    workdir = tmp_path / "w"
    prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(nan_target), data=[str(chats(tmp_path / "c.jsonl"))],
                                  eval_fraction=0.0, num_workers=1))
    with pytest.raises(PipelineError) as e:
        extract_hidden_states(extract_cfg(workdir, nan_target))
    msg = str(e.value)
    assert "\n" not in msg and str(WorkDir(workdir).store()) in msg
    assert f"train: {N_CHATS} of {N_CHATS} samples rejected for NaN/Inf" in msg and "--dtype" in msg
    assert not WorkDir(workdir).manifest("extract").exists()  # stage 04 finds no finished store
    # The complete files stay: a rerun says the same without extracting again.
    with pytest.raises(PipelineError, match="no usable train sample"), caplog.at_level("INFO"):
        extract_hidden_states(extract_cfg(workdir, nan_target))
    assert "0 to do" in caplog.text


def test_stage_02_warns_when_most_of_a_split_is_rejected(caplog):
    from eagle3.stages.s02_extract.results import _refuse_or_warn_rejected

    cfg = ExtractConfig(work_dir=Path("w"), target_model="t")
    counts = {"train_samples": 10, "train_rejected_nonfinite": 6, "eval_samples": 2, "eval_rejected_nonfinite": 0}
    with caplog.at_level("WARNING"):
        _refuse_or_warn_rejected(cfg, Path("w/02_hidden_states"), counts, complete=True)
    assert "train: 6 of 10 samples rejected" in caplog.text and "eval: 0 of 2" in caplog.text
    # An incomplete store (other boxes still running) is not judged yet.
    _refuse_or_warn_rejected(cfg, Path("w"), {**counts, "train_rejected_nonfinite": 10}, complete=False)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_scripts_exit_2_with_one_line_on_an_all_bad_input(tmp_path, tiny_llama):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"opener {i}"}) + "\n" for i in range(5)) + "{oops\n")
    common = ["--work-dir", str(tmp_path / "w"), "--target-model", str(tiny_llama)]
    for script, extra, reason in (("00_generate_responses.py", ["--data", str(bad)], "no_messages 5"),
                                  ("01_prepare_dataset.py", ["--data", str(bad)], "no_messages 5"),
                                  ("02_extract_hidden_states.py", ["--backend", "hf"], "01_prepare_dataset.py")):
        p = run_script(script, *common, *extra)
        errors = [line for line in p.stderr.splitlines() if " E eagle3" in line]
        assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, (script, p.stderr[-2000:])
        assert reason in errors[0], (script, errors[0])

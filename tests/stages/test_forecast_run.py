"""The data forecast's subcommand (eagle3/tools/forecast.py) on the tiny Llama: three
fractions of stage 04 on the session's stages 01-03, the report, and a rerun that reuses
every run. About 20 s (it trains); the fitted laws are tested in tests/unit/test_forecast.py."""
import re

from eagle3.artifacts.workdir import WorkDir
from eagle3.tools import diagnose

TINY_CONFIG = """\
train:
  ttt_steps: 3
  learning_rate: 3.0e-3
  warmup_steps: 2
  max_steps: 40
  batch_tokens: 1024
  max_seq_len: 256
  log_every: 1
  eval_every: 1000
  save_every: 1000
"""


def test_forecast_subcommand_on_a_tiny_target(tmp_path, stages_123, tiny_llama, capsys):
    """Three fractions of stage 04 on the tiny Llama (8 steps for the full one): the report
    has the points and a prediction; a rerun reuses every run instead of retraining."""
    work = tmp_path / "work"
    work.mkdir()
    for stage in ("01_dataset", "02_hidden_states", "03_vocab"):  # stages_123 stays read-only
        (work / stage).symlink_to(stages_123 / stage, target_is_directory=True)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_CONFIG)
    argv = ["forecast", "--work-dir", str(work), "--config", str(cfg), "--target-model", str(tiny_llama),
            "--target-al", "1.5", "--fractions", "0.25,0.5,1", "--max-steps", "8", "--law", "log"]
    assert diagnose.main(argv) == 0
    out = capsys.readouterr().out
    rows = {float(m[0]): (int(m[1]), int(m[2]), int(m[3])) for m in
            re.findall(r"^\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+[\d.]+\s+[\d.]+", out, re.M)}
    assert sorted(rows) == [0.25, 0.5, 1.0]
    assert [rows[f][2] for f in (0.25, 0.5, 1.0)] == [2, 4, 8]  # steps proportional to the fraction
    samples = [rows[f][0] for f in (0.25, 0.5, 1.0)]
    tokens = [rows[f][1] for f in (0.25, 0.5, 1.0)]
    assert samples[0] < samples[1] < samples[2] and tokens[0] < tokens[1] < tokens[2]
    assert re.search(r"check: the fit on fractions 0.25, 0.5 predicts the fraction-1 run \(.*\) at \d\.\d{3}", out)
    assert "law log (fit on all 3 points" in out and "laws compared" in out
    for f in ("0.25", "0.5", "1"):
        frac = WorkDir(work / "forecast" / f"frac-{f}")
        assert frac.manifest("train").is_file() and frac.stage_dir("extract").is_symlink()
    mtimes = [(work / "forecast" / f"frac-{f}" / "04_train" / "manifest.json").stat().st_mtime_ns
              for f in ("0.25", "0.5", "1")]
    assert diagnose.main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("(reused)") == 3
    assert [(work / "forecast" / f"frac-{f}" / "04_train" / "manifest.json").stat().st_mtime_ns
            for f in ("0.25", "0.5", "1")] == mtimes

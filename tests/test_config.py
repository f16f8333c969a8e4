"""Stage configs from YAML + flags, and the CLI's handling of bad input."""
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import parse_config
from eagle3.config import build_config, identity_params
from eagle3.errors import PipelineError
from eagle3.prepare import PrepareConfig
from eagle3.vocab import VocabConfig

ROOT = Path(__file__).resolve().parent.parent


def test_yaml_shared_keys_section_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_length: 100\n"
                 "vocab:\n  draft_vocab_size: 64\n")
    cfg, _ = parse_config(PrepareConfig, "prepare", ["--config", str(y), "--max-length", "200", "--strict"])
    assert cfg.data == ["a.jsonl"] and cfg.max_length == 200 and cfg.strict and cfg.work_dir == Path("w")
    v = build_config(VocabConfig, "vocab", y)
    assert v.draft_vocab_size == 64 and v.target_model == "t"
    # knobs that do not change the output stay out of the manifest's identity
    assert "num_workers" not in identity_params(cfg) and "force" not in identity_params(cfg)


def test_unknown_key_and_bad_value_are_named(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_lenght: 100\n")
    with pytest.raises(PipelineError, match=r"unknown key\(s\) \['max_lenght'\] in section `prepare`"):
        build_config(PrepareConfig, "prepare", y)
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_length: lots\n")
    with pytest.raises(PipelineError, match=r"`max_length` = 'lots' is not a valid"):
        build_config(PrepareConfig, "prepare", y)
    with pytest.raises(PipelineError, match=r"missing required setting\(s\) \['target_model'\].*--target-model"):
        build_config(PrepareConfig, "prepare", None, {"work_dir": "w", "data": "a.jsonl"})


def test_script_reports_bad_input_in_one_line_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "03_build_vocab_mapping.py"), "--work-dir", str(tmp_path),
                        "--draft-vocab-size", "10"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "01_dataset/manifest.json, which does not exist" in r.stderr and "Traceback" not in r.stderr

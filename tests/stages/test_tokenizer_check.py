"""Stages 00, 01 and 06 refuse a tokenizer that is not the one the target ships.

The target is the Kimi-K2.5 stand-in (eagle3/demo/kimi_k25_tokenizer.py, real special-token
ids, tokenizer_config.json's `added_tokens_decoder` as the real target ships it). The bad
copy reproduces what transformers 5.4.0 and 5.5.0-5.5.3 built from Kimi-K2.5's files
(transformers issue #45356, PR #45359; docs/KIMI_K25.md "Tokenizer"): a generic fast
tokenizer with the named special tokens packed densely from 163584, so every one after
163588 is 1-3 ids low and `</think>` decodes to ''. Loading it raises nothing; the check
must. No engine, no weights: seconds.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3.core.errors import PipelineError
from eagle3.target.loss_mask import assistant_suffix
from eagle3.target.info import load_tokenizer
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s00_generate.run import generate_responses
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import prepare_dataset
from eagle3.artifacts.workdir import WorkDir
from eagle3.demo.kimi_k25_tokenizer import FIRST_SPECIAL_ID, SPECIAL_TOKENS
from fixtures import save_kimi_k25_target

VERSION = __import__("transformers").__version__


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_kimi_k25_target(tmp_path_factory.mktemp("kimi") / "good")


def dense_packed(good: Path, out: Path) -> Path:
    """`good` with tokenizer.json's added tokens as transformers 5.4-5.5.3 built them from
    Kimi-K2.5's sparse `added_tokens_decoder`: the named tokens only, numbered densely from
    163584. tokenizer_config.json (what the target ships) keeps the real ids."""
    shutil.copytree(good, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    named = [t for t in spec["added_tokens"] if t["id"] in SPECIAL_TOKENS]
    for k, t in enumerate(named):
        t["id"] = FIRST_SPECIAL_ID + k
    spec["added_tokens"] = named
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def chats(path: Path) -> Path:
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi."},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    return path


def check(target: Path, trust_remote_code: bool = False) -> None:
    from eagle3.target.tokenizer_check import check_tokenizer

    tok = load_tokenizer(target)
    check_tokenizer(target, tok, trust_remote_code=trust_remote_code, suffix=assistant_suffix(tok))


def test_the_shipped_tokenizer_passes(good):
    tok = load_tokenizer(good)
    assert tok.encode("</think>", add_special_tokens=False) == [163607] and tok.decode([163607]) == "</think>"
    check(good)


def test_dense_packed_ids_are_refused_naming_token_ids_and_version(good, tmp_path):
    bad = dense_packed(good, tmp_path / "bad")
    tok = load_tokenizer(bad)  # loads without a word, as the bad releases did
    assert tok.encode("</think>", add_special_tokens=False) == [163604] and tok.decode([163607]) == ""
    with pytest.raises(PipelineError) as e:
        check(bad)
    msg = str(e.value)
    # the first template token after 163588: <|im_system|> 163594, packed to 163592
    assert "'<|im_system|>'" in msg and "163594" in msg and "[163592]" in msg, msg
    assert f"transformers {VERSION}" in msg and "tokenizer_config.json" in msg, msg


def test_generation_eos_must_be_the_masks_end_of_turn(good, tmp_path):
    target = shutil.copytree(good, tmp_path / "eos")
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 163585}))  # [EOS], not <|im_end|>
    with pytest.raises(PipelineError) as e:
        check(target)
    msg = str(e.value)
    assert "'<|im_end|>'" in msg and "163586" in msg and "163585" in msg and VERSION in msg, msg
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [163585, 163586]}))
    check(target)  # a list holding the end of turn is what servers stop on


def test_the_auto_map_class_is_required_with_remote_code(good, tmp_path):
    from eagle3.target.tokenizer_check import check_tokenizer

    target = shutil.copytree(good, tmp_path / "auto_map")
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(good)  # a TokenizersBackend, as the bad releases built for Kimi-K2.5
    with pytest.raises(PipelineError, match=r"\['TikTokenTokenizer'\].*built a TokenizersBackend"):
        check_tokenizer(target, tok, trust_remote_code=True, suffix=assistant_suffix(tok))
    check_tokenizer(target, tok, trust_remote_code=False, suffix=assistant_suffix(tok))  # ids still checked


def test_stages_00_01_and_06_refuse_before_any_work(good, tmp_path):
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import _check_target

    bad = dense_packed(good, tmp_path / "bad")
    data = [str(chats(tmp_path / "chats.jsonl"))]

    class NoEngine:
        def __getattr__(self, name):
            raise AssertionError(f"stage 00 reached the engine ({name}) with a wrong tokenizer")

    with pytest.raises(PipelineError, match="'<|im_system|>'"):
        generate_responses(GenerateConfig(work_dir=tmp_path / "wd0", target_model=str(bad), data=data),
                           engine=NoEngine())
    with pytest.raises(PipelineError, match="'<|im_system|>'"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path / "wd1", target_model=str(bad), data=data, num_workers=1))
    assert not WorkDir(tmp_path / "wd1").stage_dir("prepare").exists()
    cfg = EvaluateConfig(work_dir=tmp_path / "wd6", target_model=str(bad))
    with pytest.raises(PipelineError, match="'<|im_system|>'"):
        _check_target(cfg, None, {"vocab_size": 163840, "hidden_size": 64}, tmp_path / "drafter")
    _check_target(EvaluateConfig(work_dir=tmp_path / "wd6", target_model=str(good)), None,
                  {"vocab_size": 163840, "hidden_size": 64}, tmp_path / "drafter")

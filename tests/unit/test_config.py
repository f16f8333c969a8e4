"""Stage configs from YAML + flags, and the CLI's handling of bad input."""
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest

from eagle3.core.cli import make_parser
from eagle3.core.config import allowed_text, build_config, check_yaml_keys, identity_params, load_yaml
from eagle3.core.stages import STAGES
from eagle3.core.errors import PipelineError
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s06_evaluate.config import EvaluateConfig

ROOT = Path(__file__).resolve().parents[2]


def from_flags(cls, section: str, argv: list[str]):
    """The config a stage's script builds from these flags (eagle3/core/cli.py `run_stage`)."""
    args = make_parser(cls, None).parse_args(argv)
    return build_config(cls, section, args.config, {f.name: getattr(args, f.name) for f in fields(cls)},
                        sections=STAGE_CONFIGS)


def test_yaml_shared_keys_section_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_length: 100\n"
                 "vocab:\n  draft_vocab_size: 64\n")
    cfg = from_flags(PrepareConfig, "prepare", ["--config", str(y), "--max-length", "200", "--strict"])
    assert cfg.data == ["a.jsonl"] and cfg.max_length == 200 and cfg.strict and cfg.work_dir == Path("w")
    v = build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS)
    assert v.draft_vocab_size == 64 and v.target_model == "t"
    # knobs that do not change the output stay out of the manifest's identity
    assert "num_workers" not in identity_params(cfg) and "force" not in identity_params(cfg)


def test_unknown_key_and_bad_value_are_named(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_lenght: 100\n")
    with pytest.raises(PipelineError, match=r"unknown key\(s\) \['max_lenght'\] in section `prepare`"):
        build_config(PrepareConfig, "prepare", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  max_length: lots\n")
    with pytest.raises(PipelineError, match=r"`max_length` = 'lots' is not a valid"):
        build_config(PrepareConfig, "prepare", y, sections=STAGE_CONFIGS)
    with pytest.raises(PipelineError, match=r"missing required setting\(s\) \['target_model'\].*--target-model"):
        build_config(PrepareConfig, "prepare", None, {"work_dir": "w", "data": "a.jsonl"})


def test_script_reports_bad_input_in_one_line_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "03_build_vocab_mapping.py"), "--work-dir", str(tmp_path),
                        "--draft-vocab-size", "10"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "01_dataset/manifest.json, which does not exist" in r.stderr and "Traceback" not in r.stderr


# -- configs that cannot mislead --------------------------------------------------------

def test_misspelt_top_level_key_and_section_are_refused_with_the_closest_name(tmp_path):
    y = tmp_path / "c.yaml"
    # A misspelt `vocab:` section used to be ignored: stage 03 then built the default 32000.
    y.write_text("work_dir: w\ntarget_model: t\nvocabb:\n  draft_vocab_size: 64\n")
    with pytest.raises(PipelineError, match=r"unknown section `vocabb` \(did you mean `vocab`\?\)"):
        build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_modle: t\nvocab:\n  draft_vocab_size: 64\n")
    with pytest.raises(PipelineError, match=r"unknown top-level key `target_modle` \(did you mean `target_model`\?\)"):
        build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS)
    # a typo in another stage's section is caught by any stage, before its work
    y.write_text("work_dir: w\ntarget_model: t\nvocab:\n  draft_vocab_size: 64\ntrain:\n  ttt_step: 3\n")
    with pytest.raises(PipelineError, match=r"\['ttt_step'\] in section `train` \(did you mean `ttt_steps`\?\)"):
        build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_model: t\nvocab: 64\n")
    with pytest.raises(PipelineError, match=r"section `vocab` must be a mapping"):
        build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS)
    # a key that some stage reads is fine at the top level (here: prepare's max_length)
    y.write_text("work_dir: w\ntarget_model: t\nmax_length: 64\nvocab:\n  draft_vocab_size: 64\n")
    assert build_config(VocabConfig, "vocab", y, sections=STAGE_CONFIGS).draft_vocab_size == 64


def test_every_registered_stage_and_every_shipped_config_is_valid():
    assert list(STAGE_CONFIGS) == [s.key for s in STAGES]  # one config class per registry stage, in order
    assert STAGE_CONFIGS["prepare"] is PrepareConfig and STAGE_CONFIGS["vocab"] is VocabConfig
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        check_yaml_keys(load_yaml(p), p, STAGE_CONFIGS)  # raises on any unknown key


def test_a_yaml_file_is_never_read_without_every_stage_s_fields(tmp_path):
    # Without the map, a key of another stage's section could not be checked: refuse, do not skip.
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\n")
    with pytest.raises(TypeError, match="sections=STAGE_CONFIGS"):
        build_config(VocabConfig, "vocab", y)
    assert build_config(VocabConfig, "vocab", None, {"work_dir": "w", "target_model": "t"}).draft_vocab_size > 0


@pytest.mark.parametrize("flag, value, message", [
    ("--backend", "vlm", r"command line: `backend` = 'vlm' is not allowed \(did you mean `vllm`\?\); "
                         r"it must be one of vllm, hf \(--backend\)"),
    ("--gpu-memory-utilization", "1.5", r"`gpu_memory_utilization` = 1.5 is not allowed; it must be in \(0, 1\]"),
    ("--gpu-memory-utilization", "0", r"it must be in \(0, 1\]"),
    ("--samples-per-file", "0", r"`samples_per_file` = 0 is not allowed; it must be >= 1 \(--samples-per-file\)"),
])
def test_choices_and_ranges_are_checked_naming_where_the_value_came_from(flag, value, message):
    with pytest.raises(PipelineError, match=message):
        from_flags(ExtractConfig, "extract", ["--work-dir", "w", "--target-model", "t", flag, value])


def test_choices_and_ranges_in_a_yaml_name_the_file_and_section(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  eval_fraction: 1.0\n")
    with pytest.raises(PipelineError, match=rf"{y} \[prepare\]: `eval_fraction` = 1.0 is not allowed; "
                                            r"it must be in \[0.0, 1.0\)"):
        build_config(PrepareConfig, "prepare", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_model: t\ntrain:\n  precision: fp16\n")
    with pytest.raises(PipelineError, match=r"\[train\]: `precision` = 'fp16' is not allowed \(did you mean "
                                            r"`bf16`\?\); it must be one of auto, bf16, fp32"):
        build_config(TrainConfig, "train", y, sections=STAGE_CONFIGS)
    # the edges themselves are allowed; None stays allowed for optional fields
    y.write_text("work_dir: w\ntarget_model: t\nprepare:\n  data: a.jsonl\n  eval_fraction: 0.0\n  max_length: 8\n")
    assert build_config(PrepareConfig, "prepare", y, sections=STAGE_CONFIGS).max_length == 8
    assert build_config(EvaluateConfig, "evaluate", None, {"work_dir": "w", "target_model": "t",
                                                           "num_prompts": "none"}).num_prompts is None


def test_configs_built_in_code_obey_the_same_declarations():
    with pytest.raises(PipelineError, match=r"TrainConfig: `vocab_mode` = 'remapp' is not allowed \(did you mean "
                                            r"`remap`\?\); it must be one of keep, remap \(--vocab-mode\)"):
        TrainConfig(work_dir=Path("w"), target_model="t", vocab_mode="remapp")
    with pytest.raises(PipelineError, match=r"`draft_vocab_size` = 0 is not allowed; it must be >= 1"):
        VocabConfig(work_dir=Path("w"), draft_vocab_size=0)
    with pytest.raises(PipelineError, match=r"`learning_rate` = 0.0 is not allowed; it must be > 0"):
        TrainConfig(work_dir=Path("w"), target_model="t", learning_rate=0.0)
    with pytest.raises(PipelineError, match=r"shard_index"):  # the cross-field rule stays in __post_init__
        ExtractConfig(work_dir=Path("w"), target_model="t", num_shards=2, shard_index=2)


def test_help_shows_the_declared_choices_and_ranges():
    text = make_parser(ExtractConfig, None).format_help()
    flat = " ".join(text.split())  # argparse wraps lines
    assert "--backend {vllm,hf}" in flat and "(one of vllm, hf) (default: vllm)" in flat
    assert "0.85 on GPU) (in (0, 1])" in flat and "(>= 1) (default: 256)" in flat
    assert allowed_text(next(f for f in fields(PrepareConfig) if f.name == "eval_fraction")) == "in [0.0, 1.0)"


def test_one_dtype_spelling_whatever_the_yaml_says(tmp_path):
    from eagle3.core.config import DTYPES, ShardedStageConfig, StageConfig
    from eagle3.stages.s00_generate.config import GenerateConfig
    from eagle3.stages.s05_export.config import ExportConfig

    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nexport:\n  dtype: bf16\nextract:\n  dtype: fp16\n"
                 "generate:\n  data: a.jsonl\n  dtype: float32\n")
    # stored, and recorded, in the long form
    assert build_config(ExportConfig, "export", y, sections=STAGE_CONFIGS).dtype == "bfloat16"
    assert build_config(ExtractConfig, "extract", y, sections=STAGE_CONFIGS).dtype == "float16"
    assert build_config(GenerateConfig, "generate", y, {"dtype": "fp32"}, sections=STAGE_CONFIGS).dtype == "float32"
    assert identity_params(build_config(ExportConfig, "export", y, sections=STAGE_CONFIGS))["dtype"] in DTYPES
    with pytest.raises(PipelineError, match=r"`dtype` = 'bf61' is not allowed \(did you mean `bf16`\?\)"):
        build_config(ExtractConfig, "extract", y, {"dtype": "bf61"}, sections=STAGE_CONFIGS)
    # the shared fields come from one base: every stage config has them, declared once
    for cls in (PrepareConfig, VocabConfig, ExtractConfig, GenerateConfig, ExportConfig):
        assert issubclass(cls, StageConfig), cls
        assert {"work_dir", "target_model", "trust_remote_code", "force"} <= {f.name for f in fields(cls)}
    assert issubclass(ExtractConfig, ShardedStageConfig) and issubclass(GenerateConfig, ShardedStageConfig)


# -- coerce: a YAML or flag value becomes the field's type, or is refused -----------------

@dataclass
class _Knobs:
    steps: int = 1
    lr: float = 0.1
    strict: bool = False
    layers: list[int] = field(default_factory=list)
    limit: int | None = None


def test_coerce_converts_exact_values_and_refuses_lossy_or_unknown_ones():
    from eagle3.core.config import coerce

    def c(name, value):
        return coerce(_Knobs, name, value, "c.yaml")

    assert c("steps", 100.0) == 100 and type(c("steps", 100.0)) is int and c("steps", "7") == 7
    assert c("lr", "3e-4") == pytest.approx(3e-4) and c("layers", "2, 4,5") == [2, 4, 5]
    assert [c("strict", v) for v in ("yes", "True", "1", "no", "FALSE", "0", True)] == [True] * 3 + [False] * 3 + [True]
    assert c("limit", "none") is None and c("limit", "12") == 12
    # a fractional step count is not rounded away, an unknown word is not a truth value
    with pytest.raises(PipelineError, match=r"c\.yaml: `steps` = 100\.5 is not a valid value: `steps` takes a whole "
                                            r"number \(--steps\)"):
        c("steps", 100.5)
    for word in ("maybe", "on", "enabled"):
        with pytest.raises(PipelineError, match=rf"c\.yaml: `strict` = '{word}' is not a valid value: `strict` takes "
                                                f"true or false"):
            c("strict", word)


@pytest.mark.parametrize("key, yaml_value, message", [
    # YAML's true, [0] and [a, b] used to become 1.0, 1, True and the string "['a', 'b']"
    ("train.learning_rate", "true", r"`learning_rate` = True is a boolean, but `learning_rate` takes a "
                                    r"number; write a number, e.g. `learning_rate: 0.0001` \(--learning-rate 0.0001"),
    ("train.epochs", "true", r"`epochs` = True is a boolean, but `epochs` takes a whole number; write a "
                             r"whole number, e.g. `epochs: 1` \(--epochs 1 on the command line\)"),
    ("train.keep_windows", "[0]", r"`keep_windows` = \[0\] is a list, but `keep_windows` takes true or "
                                  r"false; write true or false, e.g. `keep_windows: true` \(--keep-windows / "
                                  r"--no-keep-windows\)"),
    ("target_model", "[a, b]", r"`target_model` = \['a', 'b'\] is a list, but `target_model` takes a "
                               r"string"),
    ("train.max_steps", "{a: 1}", r"`max_steps` = \{'a': 1\} is a mapping, but `max_steps` takes a whole number"),
    ("train.init_from", "no", r"`init_from` = False is a boolean, but `init_from` takes a string; .*quote the word"),
    # the other way round: a list field given a single value or a mapping, or items of the wrong kind
    ("train.report_to", "{wandb: 1}", r"`report_to` = \{'wandb': 1\} is a mapping, but `report_to` takes a list of "
                                      r"strings; write a list of strings, e.g. `report_to: \[a, b\]` "
                                      r"\(--report-to a,b"),
    ("train.report_to", "true", r"`report_to` = True is a boolean, but `report_to` takes a list of strings"),
    ("train.report_to", "[[wandb]]", r"`report_to` item 1 \(\['wandb'\]\) is a list, but `report_to` takes a string"),
])
def test_values_of_the_wrong_kind_are_refused_naming_the_file_key_and_fix(tmp_path, key, yaml_value, message):
    y = tmp_path / "c.yaml"
    section, _, name = key.rpartition(".")
    y.write_text(f"work_dir: w\ntarget_model: t\n{section}:\n  {name}: {yaml_value}\n" if section
                 else f"work_dir: w\n{name}: {yaml_value}\n")
    where = r"\[train\]" if section else r"\(top level\)"
    with pytest.raises(PipelineError, match=rf"{y} {where}: {message}"):
        build_config(TrainConfig, "train", y, sections=STAGE_CONFIGS)


def test_wrong_kinds_in_lists_and_mappings_and_on_the_command_line_are_refused(tmp_path):
    from eagle3.stages.s00_generate.config import GenerateConfig

    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: t\nextract:\n  aux_layers: [2, true, 58]\n")
    with pytest.raises(PipelineError, match=r"`aux_layers` item 2 \(True\) is a boolean, but `aux_layers` takes a "
                                            r"whole number; write a list of whole numbers, e.g. `aux_layers: "
                                            r"\[2, 30, 58\]` \(--aux-layers 2,30,58"):
        build_config(ExtractConfig, "extract", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_model: t\nextract:\n  aux_layers: 30\n")
    with pytest.raises(PipelineError, match=r"`aux_layers` = 30 is a number, but `aux_layers` takes a list"):
        build_config(ExtractConfig, "extract", y, sections=STAGE_CONFIGS)
    y.write_text("work_dir: w\ntarget_model: t\ngenerate:\n  data: a.jsonl\n  chat_template_kwargs: [thinking]\n")
    with pytest.raises(PipelineError, match=r"\[generate\]: `chat_template_kwargs` = \['thinking'\] is a list, but "
                                            r"`chat_template_kwargs` takes a mapping"):
        build_config(GenerateConfig, "generate", y, sections=STAGE_CONFIGS)
    # a flag's text that is not a number names the flag
    with pytest.raises(PipelineError, match=r"command line: `learning_rate` = 'true' is not a valid value: "
                                            r"`learning_rate` takes a number \(--learning-rate\)"):
        from_flags(TrainConfig, "train", ["--work-dir", "w", "--target-model", "t", "--learning-rate", "true"])


def test_values_of_the_right_kind_still_pass(tmp_path):
    from eagle3.stages.s00_generate.config import GenerateConfig

    y = tmp_path / "c.yaml"
    y.write_text("work_dir: w\ntarget_model: 2024\nextract:\n  aux_layers: '2, 30, 58'\n  window: 3.0\n"
                 "generate:\n  data: [a.jsonl, b.jsonl]\n  chat_template_kwargs: {thinking: false}\n  top_p: 1\n"
                 "  enforce_eager: 1\n")
    ext = build_config(ExtractConfig, "extract", y, sections=STAGE_CONFIGS)
    assert ext.aux_layers == [2, 30, 58] and ext.window == 3 and type(ext.window) is int
    assert ext.target_model == "2024" and ext.work_dir == Path("w")
    gen = build_config(GenerateConfig, "generate", y, {"chat_template_kwargs": '{"thinking": true}'},
                       sections=STAGE_CONFIGS)
    assert gen.data == ["a.jsonl", "b.jsonl"] and gen.top_p == 1.0 and type(gen.top_p) is float
    assert gen.enforce_eager is True and gen.chat_template_kwargs == {"thinking": True}
    assert (build_config(GenerateConfig, "generate", y, sections=STAGE_CONFIGS).chat_template_kwargs
            == {"thinking": False})


def test_fields_added_later_enter_the_identity_only_when_set_otherwise():
    """--loss, --lk-eta and --drafter-shape came after runs existed; at their defaults they
    reproduce those runs, so a work dir written before them keeps its identity (its stage 04
    complete, its checkpoints resumable). Set otherwise, each is part of the identity."""
    from eagle3.core.config import identity_params
    from eagle3.stages.s04_train.config import TrainConfig

    base = identity_params(TrainConfig(work_dir="w", target_model="t"))
    assert not {"loss", "lk_eta", "drafter_shape"} & set(base)
    assert {"learning_rate", "ttt_steps", "step_decay"} <= set(base)
    for field, value in (("loss", "tv"), ("lk_eta", 2.0), ("drafter_shape", "eagle3.1")):
        changed = identity_params(TrainConfig(work_dir="w", target_model="t", **{field: value}))
        assert changed == {**base, field: value}

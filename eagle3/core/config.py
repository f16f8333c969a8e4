"""Stage configs: dataclasses filled from a YAML file and command-line flags.

Each stage owns one dataclass in its package's `config.py` (e.g. `PrepareConfig` in
eagle3/stages/s01_prepare/config.py); eagle3/stages/configs.py maps each section to its class.
It subclasses `StageConfig` (work_dir, target_model, trust_remote_code, force) or, for
the stages that run target engines and can split their work over boxes (00 and 02),
`ShardedStageConfig`. A YAML file in configs/ has shared top-level keys (`work_dir`,
`target_model`, ...) and one section per stage of the registry (`generate:`, `prepare:`,
`extract:`, `vocab:`, `train:`, `export:`, `evaluate:`). `build_config` gives a stage's
config the top-level keys that are its fields, then its section, then the overrides
(the flags eagle3/core/cli.py generates from the same dataclass; None means not given),
converts each value to its field's type (`coerce`: a value of another kind, such as YAML's
`true` for a number or `[0]` for a flag, is refused naming the key, its file or flag and the
fix), and refuses a missing required setting naming its flag. Paths are kept as written: a
relative one is relative to the directory the command runs in.

Fields carry metadata: `help` for the CLI, `identity=False` for knobs that do not
change a stage's output (worker counts, --force), so they stay out of the
manifest's parameters and changing them does not redo a finished stage, and the
allowed values, declared once with the field (`choices=("vllm", "hf")`, `min=1`,
`gt=0`, `lt=1`, `max=1`): `build_config` checks them naming the file, key and value,
`--help` shows them, and `StageConfig.__post_init__` calls `check_params` so a config
built in code is held to the same rules.

A YAML file cannot mislead: a key no stage reads, a section no stage owns, or a key
its section's stage does not have is refused with the closest valid name (a misspelt
`vocab:` section would otherwise train with the default vocabulary size). The core
cannot import the stages, so whoever reads a YAML file passes every stage's config class
by section (`sections`: eagle3/stages/configs.py `STAGE_CONFIGS`). Refused as well: a
`generate.max_new_tokens` longer than `prepare.max_length` or `train.max_seq_len` keep
(`check_lengths`). Also here: the dtype names stages accept (`dtype_name`, `torch_dtype`)
and a stage's `data` setting as a list (`data_sources`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from eagle3.core.errors import PipelineError


def param(default: Any = dataclasses.MISSING, *, help: str, identity: bool = True,
          identity_unless_default: bool = False,
          default_factory: Any = dataclasses.MISSING, choices: tuple | None = None,
          min: float | None = None, max: float | None = None,
          gt: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with CLI help, the identity flag and its allowed values.

    `choices`: the allowed values; `min`/`max`: inclusive bounds, `gt`/`lt`: exclusive
    ones. None (for optional fields) is always allowed; list fields are checked per item.
    `identity_unless_default`: a field added after runs existed, whose default reproduces
    what those runs did, enters the identity only when set otherwise, so a work dir (its
    finished stages, its checkpoints) written before the field existed stays complete and
    resumable under the new code.
    """
    meta = {"help": help, "identity": identity, "identity_unless_default": identity_unless_default}
    for k, v in (("choices", choices), ("min", min), ("max", max), ("gt", gt), ("lt", lt)):
        if v is not None:
            meta[k] = tuple(v) if k == "choices" else v
    kw = {"metadata": meta}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, **kw)
    return dataclasses.field(default=default, **kw)


# One spelling of a dtype: the names transformers and vLLM use. The short names are
# accepted as aliases in YAML and flags (`dtype: bf16`) and stored in the long form.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_CHOICES = DTYPES + tuple(DTYPE_ALIASES)


def dtype_name(name: str) -> str:
    """The one spelling of a dtype name ('bf16' -> 'bfloat16')."""
    name = DTYPE_ALIASES.get(str(name), str(name))
    if name not in DTYPES:
        raise PipelineError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}{closest(name, DTYPE_CHOICES)}.")
    return name


def torch_dtype(name: str):
    """The torch dtype of a dtype name or alias."""
    import torch

    return getattr(torch, dtype_name(name))


def identity_params(cfg) -> dict:
    """The fields that define a stage's output: what the manifest records."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("identity", True):
            v = getattr(cfg, f.name)
            if f.metadata.get("identity_unless_default") and v == f.default:
                continue
            out[f.name] = str(v) if isinstance(v, Path) else v
    return out


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unwrap_optional(tp):
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


# What each field type takes, in words, and an example of it (YAML form, flag form) for messages.
_TAKES = {int: ("a whole number", "8", "8"), float: ("a number", "0.5", "0.5"), bool: ("true or false", "true", ""),
          str: ("a string", '"text"', "text"), Path: ("a path", "some/folder", "some/folder"),
          dict: ("a mapping", "{key: value}", "'{\"key\": \"value\"}'")}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


class _WrongKind(TypeError):
    """A value of another kind than its field takes (a boolean for a number, a list for a string, ...)."""


def _kind(value: Any) -> str:
    """A YAML value's kind in words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple, set)):
        return "a list"
    return f"a {type(value).__name__}"


def _scalar(tp, value: Any):
    """`value` as one value of type `tp`. Raises _WrongKind for a value of another kind (YAML reads
    `true`, `[0]` and `{a: 1}` as a boolean, a list and a mapping, and Python's int(), float(),
    str() and bool() would take each of them), ValueError for a string or number that is not one."""
    if isinstance(value, (list, tuple, set, dict)) and tp is not dict:
        raise _WrongKind(value)
    if tp is bool:
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise _WrongKind(value) if not isinstance(value, str) else ValueError(value)
    if isinstance(value, bool):  # a bool is an int to Python: True would pass as 1
        raise _WrongKind(value)
    if tp in (int, float):
        if not isinstance(value, (int, float, str)):
            raise _WrongKind(value)
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return tp(value)
    if tp in (str, Path):
        if not isinstance(value, (str, int, float, os.PathLike)):
            raise _WrongKind(value)
        return tp(value) if tp is Path else str(value)
    if tp is dict:  # a mapping, or its JSON text (a flag); the stage's config parses the text
        if not isinstance(value, (dict, str)):
            raise _WrongKind(value)
        return value
    return value


def _words(tp) -> str:
    """What a field of type `tp` takes, in words ('a list of whole numbers')."""
    if typing.get_origin(tp) is list:
        return "a list of " + _words(typing.get_args(tp)[0]).removeprefix("a ") + "s"
    return _TAKES[tp][0] if tp in _TAKES else f"a {getattr(tp, '__name__', tp)}"


def _default_example(cls, name: str, tp) -> str | None:
    """The field's default as a YAML example, when it is a plain value of the field's type."""
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    default = f.default if f is not None else dataclasses.MISSING
    if type(default) is tp and tp in (int, float):
        return str(default)
    if type(default) is str and tp is str and default:
        return f'"{default}"'
    return None


def _wrong_kind(cls, name: str, tp, value: Any, source: str, item: int | None = None) -> PipelineError:
    """The message for a value of the wrong kind: where it came from, what the field takes, the fix."""
    flag = "--" + name.replace("_", "-")
    what = f"`{name}` = {value!r}" if item is None else f"`{name}` item {item + 1} ({value!r})"
    words = _words(tp)
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        yaml, flag_form = ("[2, 30, 58]", "2,30,58") if item_tp in (int, float) else ("[a, b]", "a,b")
        taken = words if item is None else _words(item_tp)
    else:
        _, yaml, flag_form = _TAKES.get(tp, (words, "...", "..."))
        yaml = _default_example(cls, name, tp) or yaml
        flag_form = flag_form and (_default_example(cls, name, tp) or flag_form).strip('"')
        taken = words
    fix = f"write {words}, e.g. `{name}: {yaml}`" + (f" ({flag} {flag_form} on the command line)" if flag_form
                                                     else f" ({flag} / --no-{name.replace('_', '-')})")
    if isinstance(value, bool) and (tp is str or tp is Path):
        fix += "; YAML reads an unquoted true/false/yes/no/on/off as a boolean, so quote the word you meant"
    return PipelineError(f"{source}: {what} is {_kind(value)}, but `{name}` takes {taken}; {fix}.")


def coerce(cls, name: str, value: Any, source: str):
    """Convert a YAML/CLI value to the field's type, or explain what is wrong.

    Strings are parsed (flags are strings: `--aux-layers 2,30,58`, `--strict yes`). A value of
    another kind is refused, naming the key, where it came from and the fix: a boolean for a
    number, string or path; a list or mapping for a single value; a boolean, number or mapping
    for a list (and a list, boolean or mapping item inside one); anything but a mapping (or its
    JSON text) for a mapping. Numbers are taken for strings and paths (a name can be numeric)."""
    tp, optional = unwrap_optional(field_types(cls)[name])
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise PipelineError(f"{source}: `{name}` must be set (got null).")
    try:
        if typing.get_origin(tp) is list:
            (item_tp,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            elif not isinstance(value, (list, tuple)):
                raise _wrong_kind(cls, name, tp, value, source)
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(_scalar(item_tp, v))
                except _WrongKind:
                    raise _wrong_kind(cls, name, tp, v, source, item=i) from None
            return out
        if tp in _TAKES:
            return _scalar(tp, value)
    except _WrongKind:
        raise _wrong_kind(cls, name, tp, value, source) from None
    except (TypeError, ValueError) as e:
        raise PipelineError(f"{source}: `{name}` = {value!r} is not a valid value: `{name}` takes {_words(tp)} "
                            f"(--{name.replace('_', '-')}).") from e
    return value


def load_yaml(path: Path | str) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"config file {path} does not exist; pass one of configs/*.yaml with --config.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise PipelineError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: the top level must be a mapping of keys to values.")
    return data


def closest(name: str, valid) -> str:
    """` (did you mean `x`?)` for the closest valid name, or '' when none is close."""
    match = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean `{match[0]}`?)" if match else ""


def allowed_text(f: dataclasses.Field) -> str:
    """The declared choices or range of a field in words ('' when it declares none)."""
    m = f.metadata
    if "choices" in m:
        return "one of " + ", ".join(str(c) for c in m["choices"])
    lo = ("[", m["min"]) if "min" in m else ("(", m["gt"]) if "gt" in m else None
    hi = (m["max"], "]") if "max" in m else (m["lt"], ")") if "lt" in m else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + str(lo[1])
    if hi:
        return ("<= " if hi[1] == "]" else "< ") + str(hi[0])
    return ""


def _allowed(f: dataclasses.Field, v: Any) -> bool:
    m = f.metadata
    if "choices" in m:
        return v in m["choices"]
    return not (("min" in m and v < m["min"]) or ("max" in m and v > m["max"])
                or ("gt" in m and not v > m["gt"]) or ("lt" in m and not v < m["lt"]))


def check_value(f: dataclasses.Field, value: Any, source: str) -> None:
    """Raise if `value` is outside the field's declared choices or range."""
    if value is None or not allowed_text(f):
        return
    for v in (value if isinstance(value, list) else [value]):
        if not _allowed(f, v):
            hint = closest(v, f.metadata["choices"]) if "choices" in f.metadata and isinstance(v, str) else ""
            what = f"`{f.name}` = {v!r}" if v is value else f"`{f.name}` item {v!r} (of {value!r})"
            raise PipelineError(f"{source}: {what} is not allowed{hint}; it must be {allowed_text(f)} "
                                f"(--{f.name.replace('_', '-')}).")


def check_params(cfg) -> None:
    """Check every field of a built config against its declared choices and ranges."""
    for f in dataclasses.fields(cfg):
        check_value(f, getattr(cfg, f.name), type(cfg).__name__)


@dataclasses.dataclass(kw_only=True)
class StageConfig:
    """The settings every stage shares. A stage's config subclasses it (declare the
    subclass `@dataclass(kw_only=True)` as well) and may redeclare a field to change its
    default or help; `__post_init__` checks the declared choices and ranges."""

    work_dir: Path = param(help="work directory (one folder per stage inside)")
    target_model: str = param(help="target model: a local folder or a model id")
    trust_remote_code: bool = param(False, help="allow the target's custom code (only if you trust it)")
    force: bool = param(False, identity=False, help="redo the stage even if it is complete")

    def __post_init__(self):
        check_params(self)


@dataclasses.dataclass(kw_only=True)
class ShardedStageConfig(StageConfig):
    """A stage that runs target engines and can split its work over boxes and engines
    (stages 00 and 02). None of this changes what the stage writes (identity=False)."""

    num_shards: int = param(1, min=1, identity=False, help="number of boxes splitting the work")
    shard_index: int = param(0, min=0, identity=False, help="this box's index in [0, num_shards)")
    # tensor_parallel_size, the engine's own setting, is declared with the engine's others
    # (eagle3/engines/config.py's EngineSettings, which stages 00 and 02 also inherit).
    data_parallel_size: int = param(1, min=1, identity=False, help="engines on this box (for targets that fit "
                                                                  "tensor_parallel_size GPUs), one process each")

    def __post_init__(self):
        super().__post_init__()
        if not self.shard_index < self.num_shards:
            raise PipelineError(f"--shard-index {self.shard_index} with --num-shards {self.num_shards}: "
                                f"need 0 <= shard_index < num_shards.")


def data_sources(data: list[str] | str, section: str) -> list[str]:
    """A stage's `data` setting as a list (one YAML string is one source); empty is refused."""
    data = [data] if isinstance(data, str) else list(data or [])
    if not data:
        raise PipelineError(f"{section}.data is empty; pass --data FILE.jsonl (or a datasets id).")
    return data


def check_yaml_keys(data: dict, yaml_path: Path | str, sections: Mapping[str, type]) -> None:
    """Refuse top-level keys no stage reads, unknown sections and unknown keys in any section.

    `sections`: every stage's config class by its YAML section (eagle3/stages/configs.py)."""
    fields = {s: {f.name for f in dataclasses.fields(c)} for s, c in sections.items()}
    shared = set().union(*fields.values())
    problems = []
    for key, value in data.items():
        if key in sections:
            if value is None:
                continue
            if not isinstance(value, dict):
                problems.append(f"section `{key}` must be a mapping of keys to values, not {value!r}")
                continue
            for k in sorted(set(value) - fields.get(key, set(value))):
                problems.append(f"unknown key(s) ['{k}'] in section `{key}`{closest(k, fields[key])}")
        elif key not in shared:
            if isinstance(value, dict):
                problems.append(f"unknown section `{key}`{closest(key, sections)}; the stage sections are "
                                f"{', '.join(sections)}")
            else:
                problems.append(f"unknown top-level key `{key}`{closest(key, sorted(shared) + list(sections))}")
    if problems:
        raise PipelineError(f"{yaml_path}: " + "; ".join(problems) + ". Top-level keys are the settings stages "
                            f"share (e.g. work_dir, target_model); each stage's other settings go in its section.")


def _setting(data: dict, sections: Mapping[str, type], section: str, key: str) -> int | None:
    """A stage setting's value in this YAML: the section's, else the stage's default."""
    sec = data.get(section) if isinstance(data.get(section), dict) else {}
    if key in sec:
        return sec[key]
    cls = sections[section]
    f = {f.name: f for f in dataclasses.fields(cls)}.get(key)
    return f.default if f is not None and f.default is not dataclasses.MISSING else None


def check_lengths(data: dict, yaml_path: Path | str, sections: Mapping[str, type]) -> None:
    """Refuse a YAML whose stage 00 answers may run longer than stages 01/04 keep.

    A turn generated to `generate.max_new_tokens` is truncated at `prepare.max_length` and
    cropped at `train.max_seq_len`: for a thinking model the part cut off is the end of the
    reasoning and the answer itself, which then is never trained (docs/KIMI_K25.md, "Rope and
    length as served"). Checked only when the YAML sets `generate.max_new_tokens`."""
    gen = data.get("generate")
    if not isinstance(gen, dict) or gen.get("max_new_tokens") is None:
        return
    new = int(gen["max_new_tokens"])
    short = [(f"{s}.{k}", int(v)) for s, k in (("prepare", "max_length"), ("train", "max_seq_len"))
             if (v := _setting(data, sections, s, k)) is not None and int(v) < new]
    if short:
        shown = ", ".join(f"{name} = {v}" for name, v in short)
        raise PipelineError(
            f"{yaml_path}: generate.max_new_tokens = {new} exceeds {shown}: an answer that long loses its last "
            f"{new - min(v for _, v in short)} or more tokens (the end of the reasoning and the answer) before "
            f"training; raise {' and '.join(n for n, _ in short)} to at least {new} plus the prompt, or lower "
            f"generate.max_new_tokens.")


def build_config(cls, section: str, yaml_path: Path | str | None = None, overrides: dict | None = None, *,
                 sections: Mapping[str, type] | None = None):
    """Shared YAML keys, then the YAML section, then `overrides` (CLI flags).

    `sections`: every stage's config class by its YAML section (eagle3/stages/configs.py
    `STAGE_CONFIGS`), required with a YAML file: the whole file is checked against them."""
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # key -> where its value came from, for messages
    if yaml_path is not None:
        if sections is None:
            raise TypeError("build_config: a YAML file is checked against every stage's fields; pass "
                            "sections=STAGE_CONFIGS (eagle3/stages/configs.py)")
        data = load_yaml(yaml_path)
        check_yaml_keys(data, yaml_path, sections)
        check_lengths(data, yaml_path, sections)
        top = {k: v for k, v in data.items() if k in names and k not in sections}
        values.update(top)
        where.update({k: f"{yaml_path} (top level)" for k in top})
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise PipelineError(f"{yaml_path}: section `{section}` must be a mapping.")
        unknown = sorted(set(sec) - names)
        if unknown:  # a stage not (yet) in the registry
            raise PipelineError(
                f"{yaml_path}: unknown key(s) {unknown} in section `{section}`{closest(unknown[0], names)}; "
                f"valid keys are {sorted(names)}.")
        values.update(sec)
        where.update({k: f"{yaml_path} [{section}]" for k in sec})
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    values.update(flags)
    where.update({k: "command line" for k in flags})
    source = f"{yaml_path} [{section}]" if yaml_path else f"[{section}]"
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise PipelineError(f"{source}: missing required setting(s) {missing}; set them in the YAML or pass {flags}.")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    coerced = {}
    for k, v in values.items():
        coerced[k] = coerce(cls, k, v, where.get(k, source))
        check_value(by_name[k], coerced[k], where.get(k, source))
    return cls(**coerced)

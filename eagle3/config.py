"""Stage configs: dataclasses filled from a YAML file and command-line flags.

Each stage owns one dataclass (e.g. `PrepareConfig` in eagle3/prepare.py). A YAML
file in configs/ has shared top-level keys (`work_dir`, `target_model`, ...) and one
section per stage (`prepare:`, `extract:`, `vocab:`, `train:`, `export:`); a stage's
config takes the shared keys that are its fields, then its section, then flags.
Relative paths are relative to the directory the command runs in.

Fields carry metadata: `help` for the CLI, and `identity=False` for knobs that do
not change a stage's output (worker counts, --force), so they stay out of the
manifest's parameters and changing them does not redo a finished stage.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from .errors import PipelineError


def param(default: Any = dataclasses.MISSING, *, help: str, identity: bool = True,
          default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with CLI help and the identity flag."""
    kw = {"metadata": {"help": help, "identity": identity}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, **kw)
    return dataclasses.field(default=default, **kw)


def identity_params(cfg) -> dict:
    """The fields that define a stage's output: what the manifest records."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("identity", True):
            v = getattr(cfg, f.name)
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


def coerce(cls, name: str, value: Any, source: str):
    """Convert a YAML/CLI value to the field's type, or explain what is wrong."""
    tp, optional = unwrap_optional(field_types(cls)[name])
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise PipelineError(f"{source}: `{name}` must be set (got null).")
    try:
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [item(v) for v in value]
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes"):
                    return True
                if value.lower() in ("0", "false", "no"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is Path:
            return Path(value)
        if tp in (int, float, str):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return tp(value)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"{source}: `{name}` = {value!r} is not a valid {tp}.") from e
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


def build_config(cls, section: str, yaml_path: Path | str | None = None, overrides: dict | None = None):
    """Shared YAML keys, then the YAML section, then `overrides` (CLI flags)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if yaml_path is not None:
        data = load_yaml(yaml_path)
        stage_keys = {"prepare", "extract", "vocab", "train", "export", "evaluate"}
        values.update({k: v for k, v in data.items() if k in names and k not in stage_keys})
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise PipelineError(f"{yaml_path}: section `{section}` must be a mapping.")
        unknown = sorted(set(sec) - names)
        if unknown:
            raise PipelineError(
                f"{yaml_path}: unknown key(s) {unknown} in section `{section}`; "
                f"valid keys are {sorted(names)}.")
        values.update(sec)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    source = f"{yaml_path} [{section}]" if yaml_path else f"[{section}]"
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise PipelineError(f"{source}: missing required setting(s) {missing}; set them in the YAML or pass {flags}.")
    return cls(**{k: coerce(cls, k, v, source) for k, v in values.items()})

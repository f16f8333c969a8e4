"""The numbered scripts' shared command line: flags generated from a stage config.

A numbered script imports its stage's config class and entry function and calls
`run_stage(PrepareConfig, "prepare", prepare_dataset, __doc__, sections=STAGE_CONFIGS)`:
the script gets `--config FILE`, one `--flag` per config field (help from the field's
metadata), logging set up once, the stage's log file, and bad input reported as one
clear line with exit status 2. `sections` (eagle3/stages/configs.py) is what the YAML
file is checked against; this module, below the stages, cannot import it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from typing import Any, Callable, Mapping

from eagle3.artifacts.manifest import stage_run
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import allowed_text, build_config, field_types, unwrap_optional
from eagle3.core.errors import PipelineError
from eagle3.core.logs import log_to_file, setup_logging
from eagle3.core.stages import STAGE


def make_parser(cls, description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file in configs/ (shared keys + one section per stage)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--allow-stale", action="store_true",
                   help="use inputs built from upstream artifacts that were rebuilt since, instead of refusing "
                        "(recorded in this stage's manifest)")
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp, _ = unwrap_optional(types_[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = f.metadata.get("help", "")
        if allowed_text(f):  # declared once with the field; build_config checks it
            help_ += f" ({allowed_text(f)})"
        if default is not None and default != "":
            help_ += f" (default: {default})"
        # Choices are shown, not enforced by argparse: build_config's message names the
        # flag, the value, the allowed set and the closest match.
        metavar = "{" + ",".join(map(str, f.metadata["choices"])) + "}" if "choices" in f.metadata else None
        if tp is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(tp) is list:
            p.add_argument(flag, dest=f.name, default=None, metavar="A,B,...", help=help_)
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=metavar, help=help_)
    return p


def run_stage(cls, section: str, fn: Callable[[Any], Any], description: str | None = None,
              argv: list[str] | None = None, *, sections: Mapping[str, type]) -> None:
    """Stage `section` from the command line: its config `cls` built from `--config` and the
    flags, then `fn(config)`. `sections`: every stage's config class by YAML section."""
    assert sections[section] is cls, f"stage {section!r} is configured by {sections[section].__name__}"
    try:
        args = make_parser(cls, description).parse_args(argv)
        setup_logging(logging.DEBUG if args.verbose else logging.INFO)
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        cfg = build_config(cls, section, args.config, overrides, sections=sections)
        if getattr(cfg, "work_dir", None):
            log_to_file(WorkDir(cfg.work_dir).log_file(f"{STAGE[section].number}_{section}"))
            logging.getLogger("eagle3").info("command: %s", " ".join(sys.argv))
        with stage_run(allow_stale=args.allow_stale, config=args.config):
            fn(cfg)
    except PipelineError as e:
        logging.getLogger("eagle3").error("%s", e)
        sys.exit(2)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave_without_teardown()


def leave_without_teardown() -> None:
    """Exit 0 now, skipping the interpreter's teardown: for one rank of a torchrun run that
    finished well. Its ranks met at a barrier and destroyed their group, and every output
    is on disk (atomic writes); yet the teardown can still abort in gloo's transport
    threads ("terminate called without an active exception", SIGABRT: seen in CI on rank
    1 of a finished two-rank stage 04), which torchrun reports as a failed run."""
    logging.shutdown()  # flushes the log file and the console
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""`diagnose forecast --work-dir W --target-al AL`: the command line of eagle3/tools/forecast.py.

The forecast itself (stage 04 on nested fractions of the data, the fitted law, the
report) lives in eagle3/tools/forecast.py and docs/FORECAST.md; this module gives it its
flags. Exit status 1 when the check (the fit on the smaller fractions against the largest
run) lands outside its interval.
"""
from __future__ import annotations

import argparse
from typing import Any

from eagle3.tools import forecast

NAME = "forecast"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="train on nested fractions of the data and forecast the training tokens "
                                  "that reach a target acceptance (docs/FORECAST.md)")
    p.add_argument("--work-dir", required=True, help="work dir with stages 01-03 done (its fraction runs go to "
                                                     "WORK/forecast/)")
    p.add_argument("--target-al", type=float, required=True, help="held-out expected accept length to reach "
                                                                  "(e.g. a deployment's break-even)")
    p.add_argument("--config", help="the YAML file of the run: its train section is the full run's settings")
    p.add_argument("--target-model", help="target model folder (default: the config's target_model)")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in forecast.DEFAULT_FRACTIONS),
                   help="fractions of the train split, comma-separated (default %(default)s)")
    p.add_argument("--fit-upto", type=float, default=forecast.DEFAULT_FIT_UPTO,
                   help="the check fits on the fractions up to this one and predicts the largest (default "
                        "%(default)s)")
    p.add_argument("--law", choices=tuple(forecast.LAWS), default=forecast.DEFAULT_LAW,
                   help="the law fitted (default %(default)s; docs/FORECAST.md compares them)")
    p.add_argument("--max-steps", type=int, help="the full run's steps (default: train.max_steps, or its epochs' "
                                                 "steps); a fraction f runs round(f * this)")
    p.add_argument("--warmup-steps", type=int, help="the full run's warmup steps (default: train.warmup_steps)")
    p.add_argument("--device", help="stage 04's --device (default: the config's)")
    return p


def run(a: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = forecast.run_forecast(a.work_dir, target_al=a.target_al, config=a.config, target_model=a.target_model,
                              fractions=forecast.parse_fractions(a.fractions), fit_upto=a.fit_upto,
                              law=a.law, max_steps=a.max_steps, warmup_steps=a.warmup_steps, device=a.device)
    return r, forecast.format_report(r), (1 if r["chosen"].get("check", {}).get("inside") is False else 0)

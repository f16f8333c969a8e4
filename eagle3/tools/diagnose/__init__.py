"""Diagnostics for drafters, vocab mappings and hidden-state stores.

    python -m eagle3.tools.diagnose inspect DIR [--target-config PATH_OR_DIR] [--json]
    python -m eagle3.tools.diagnose compare-vocab A B [--dataset WORK_DIR] [--json]
    python -m eagle3.tools.diagnose probe-hidden WORK_A WORK_B [--split eval] [--max-samples N] [--json]
    python -m eagle3.tools.diagnose parity DIR [--checkpoint CKPT | --work-dir W] [--target-config T]
                                       [--engines vllm,sglang] [--steps 3] [--positions 0,100000] [--json]
    python -m eagle3.tools.diagnose versions [--json]
    python -m eagle3.tools.diagnose store-size --config CFG [--work-dir W] [--store-dtype fp8] [--json]
    python -m eagle3.tools.diagnose forecast --work-dir W --target-al 2.46 [--config CFG] [--fractions 0.125,0.25,0.5,1]
                                       [--fit-upto 0.5] [--law log] [--json]

`inspect` reads any drafter folder (ours, or a published one such as an SGLang-format
drafter) and says what vLLM and SGLang will do with it: tensor names and shapes, d2t
sanity, the layers each engine (and each of vLLM's two model runners) captures,
context length and tie_word_embeddings against a target. It exits 1 when anything would fail or silently misbehave in an
engine, 0 otherwise, and 2 when the folder cannot be read.

`parity` builds vLLM's and SGLang's own EAGLE-3 drafter classes from the folder on the CPU
and runs them on the same aux states, tokens and positions as the drafter as trained (a stage
04 checkpoint, or the folder itself), over K chained steps: the largest logit difference per
engine and step, the agreement of the proposed target ids, and the field behind any
difference (a tensor, d2t, rope_scaling, the aux layer ids each engine captures). It exits 1
when an engine serves the drafter otherwise than trained (eagle3/tools/parity/check.py).

`compare-vocab` compares two draft vocabularies (a drafter folder, a stage 03 folder
or work dir, or a d2t/t2d file): positions differing, tokens shared or only in one,
and with `--dataset` the coverage each gets on a stage 01 dataset's assistant tokens.

`probe-hidden` compares two targets' hidden-state stores (stage 02 of two work dirs
over the same samples): cosine similarity per aux layer and per position range, to
judge whether a drafter trained on one target can serve the other.

`store-size` prints the bytes stage 02 will write for this dataset (stage 01's
record: samples and tokens per split), target (hidden size, aux layer count
from its config and `extract.aux_layers`) and store encoding (`extract.store_dtype`,
or `--store-dtype`), for every encoding side by side, and the free space where the work
dir lies. It exits 1 when the chosen encoding does not fit: stage 02 itself refuses to
start then (eagle3/artifacts/store/writer.py `require_free_space`, on what is still to be written).

`forecast` trains stage 04 on nested fractions of W's train split (budgets proportional
to their size, each in W/forecast/frac-<f>/ over symlinks to W's stages 00-03; a
finished fraction is reused), fits held-out acceptance length against training tokens
with a documented law, and prints the points, the law, the tokens (and conversations)
expected to reach --target-al with a 95% interval, and the check: the fit on fractions
<= --fit-upto against the largest run. It exits 1 when that check lands outside its
interval (eagle3/tools/forecast.py, docs/FORECAST.md).

`versions` prints the installed vllm, sglang, torch and transformers against the
minimums the drafters and engine rules here are right for (eagle3/serving/engine_rules.py
`VERSION_RULES`), with a verdict; it exits 1 when one is too old (or may be).

This module prints its reports (that is its product); everything else logs.
"""
from __future__ import annotations

# One module per subcommand (NAME, add_parser, run, and the functions it reports with);
# this one builds the command line and prints.
import argparse
import json
import logging
import sys

from eagle3.core.errors import PipelineError
from eagle3.core.logs import setup_logging
from eagle3.tools import forecast
from eagle3.tools.diagnose import compare_vocab, inspect, parity, probe_hidden, store_size, versions

SUBCOMMANDS = (inspect, parity, compare_vocab, probe_hidden, versions, store_size, forecast)  # the order --help lists


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.tools.diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in SUBCOMMANDS:
        sp = command.add_parser(sub)
        sp.add_argument("--json", action="store_true", help="print the report as JSON")
        sp.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    # forecast trains for minutes: stage 04's progress lines are its only sign of life
    setup_logging(logging.DEBUG if a.verbose else logging.INFO if a.cmd == forecast.NAME else logging.WARNING)
    try:
        r, text, rc = next(c for c in SUBCOMMANDS if c.NAME == a.cmd).run(a)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2, default=str) if a.json else text)
    return rc

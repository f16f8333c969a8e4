"""How often would re-tokenizing a regenerated answer's decoded text give other ids?

    python bench/reencode_drift.py --work-dir work/tiny-llama --target work/targets/tiny-llama
    python bench/reencode_drift.py --work-dir work/tiny-llama --target work/targets/tiny-llama --template kimi_k2

Reads stage 00's chunks (00_generate/) and, for every regenerated assistant turn,
compares the ids the target generated with what rendering the decoded text would
give (the stage-01 path for plain chats, `build_samples`), with the target's own chat
template or with a Kimi-K2 style one (tests/fixtures.py; its header tokens
added as special tokens: only tokenization runs here, no model; the stop token each
finished answer ended on stands for that template's end-of-turn token). Splits the
differences into those inside the answer (the decoded text alone re-encodes to other
ids) and those at its boundary with the template (the text alone is fine, in context
it is not). Stage 01 never re-tokenizes these turns (`--data generated`); this is what
it would have cost.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from eagle3.target.chats import BadRecord  # noqa: E402
from eagle3.target.loss_mask import Answer, assistant_suffix, reencode_differs  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--template", default="own", help="own, or a template name of tests/fixtures.py")
    args = ap.parse_args(argv)
    from eagle3.artifacts.workdir import WorkDir
    from eagle3.target.info import load_tokenizer

    tok = load_tokenizer(args.target)
    if args.template != "own":
        from fixtures import TEMPLATES

        spec = TEMPLATES[args.template]
        tok.add_special_tokens({"additional_special_tokens": spec["special"]})
        tok.chat_template = spec["template"]
    suffix = assistant_suffix(tok)
    m = json.loads(WorkDir(args.work_dir).manifest("generate").read_text())
    kw = m["record"]["chat_template_kwargs"]
    stop = set(m["record"]["stop_token_ids"])
    if args.template != "own":
        stop.add(suffix[0])
    turns = differs = inside = unplaced = 0
    for k in range(m["record"]["num_chunks"]):
        for line in WorkDir(args.work_dir).generate_chunk(k).read_text().splitlines():
            rec = json.loads(line)
            if "generated" not in rec:
                continue
            answers = [Answer(g["ids"], g["finish_reason"] != "length") for g in rec["generated"]]
            if args.template != "own":  # the target ended its turns with its own end-of-turn token
                answers = [Answer(a.ids[:-1] + suffix[:1], True) if a.finished and a.ids[-1:] and
                           a.ids[-1] in stop else a for a in answers]
            turns += len(answers)
            try:
                flags = reencode_differs(tok, rec["messages"], answers, suffix, kw)
            except BadRecord:
                flags, unplaced = [True] * len(answers), unplaced + len(answers)
            differs += sum(flags)
            for a in answers:
                body = a.ids[:-1] if a.finished and a.ids and a.ids[-1] in stop else a.ids
                text = tok.decode(body, skip_special_tokens=False)
                inside += tok.encode(text, add_special_tokens=False) != body
    out = {"template": args.template, "turns": turns, "reencode_differs": differs,
           "reencode_differs_pct": round(100.0 * differs / max(turns, 1), 2),
           "differs_inside_answer": inside, "template_cannot_place": unplaced}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

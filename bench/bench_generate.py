"""Benchmark of stage 00 on vLLM's CPU build: generated tokens/s of the stage vs bare `LLM.generate`.

    python bench/bench_generate.py                          # tiny Llama (the demo's if built), 200 demo chats
    python bench/bench_generate.py --chats 400 --max-new-tokens 128 --passes 5

One engine, started once (startup not timed), serves both, passes alternating:
  stage   `generate_responses` into a fresh work directory: reading the chats, rendering
          each turn's prompt (token ids), one `generate` call per round of a chunk,
          decoding answers, writing the chunks atomically, the manifest;
  bare    `LLM.generate` over exactly the requests the stage sent (the same prompt ids,
          rounds, sampling settings and seeds), recorded from a warm-up stage pass.
The prefix cache is reset before every pass, and which of the two goes first alternates. Prints generated tokens/s of each (medians
over passes) and the stage's overhead (goal: < 5%).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.artifacts.manifest import record_of  # noqa: E402
from eagle3.core.logs import setup_logging  # noqa: E402

log = logging.getLogger("bench_generate")


class Recording:
    """The engine as the stage sees it, keeping each round's requests for the bare replay."""

    def __init__(self, engine):
        self.engine, self.max_model_len, self.rounds = engine, engine.max_model_len, []

    def set_sampling(self, *a):
        self.engine.set_sampling(*a)

    def generate(self, requests):
        self.rounds.append(list(requests))
        return self.engine.generate(requests)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target folder (default: the demo's trained tiny Llama if built, else an "
                                     "untrained one)")
    ap.add_argument("--chats", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args(argv)
    setup_logging(logging.WARNING)

    from eagle3.stages.s00_generate.config import GenerateConfig
    from eagle3.stages.s00_generate.run import generate_responses
    from eagle3.engines.config import EngineConfig
    from eagle3.stages.s00_generate.vllm_runner import VllmEngine
    from eagle3.demo.tiny import build_tiny_target

    work = Path(tempfile.mkdtemp(prefix="bench_generate."))
    demo = ROOT / "work" / "targets" / "tiny-llama"
    target = Path(args.target) if args.target else (demo if (demo / "config.json").is_file()
                                                    else build_tiny_target("llama", work / "tiny-llama"))
    chats = work / "chats.jsonl"
    chats.write_text("".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines(True)[:args.chats]))
    engine = VllmEngine(EngineConfig(model=str(target), max_model_len=2048, max_num_seqs=256))

    def cfg(n: int) -> GenerateConfig:
        return GenerateConfig(work_dir=work / f"wd-{n}", target_model=str(target), data=[str(chats)],
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              chunk_size=args.chunk_size, max_model_len=2048)

    rec = Recording(engine)
    engine.reset_prefix_cache()
    generate_responses(cfg(0), engine=rec)  # warm-up, and the requests the bare passes replay
    from vllm.inputs import TokensPrompt

    def stage_pass(n: int) -> tuple[float, int]:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        m = generate_responses(cfg(n), engine=engine)
        return time.perf_counter() - t0, record_of(m).generated_tokens

    def bare_pass() -> tuple[float, int]:
        engine.reset_prefix_cache()
        t0, tokens = time.perf_counter(), 0
        for reqs in rec.rounds:
            outs = engine.llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs],
                                       [engine.sampling_params(r) for r in reqs], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return time.perf_counter() - t0, tokens

    stage, bare = [], []
    for i in range(args.passes):
        if i % 2:  # alternate which goes first: a pass right after another may run warmer
            b_t, b_n = bare_pass()
            s_t, s_n = stage_pass(i + 1)
        else:
            s_t, s_n = stage_pass(i + 1)
            b_t, b_n = bare_pass()
        stage.append(s_n / s_t)
        bare.append(b_n / b_t)
        print(f"pass {i + 1}: stage {s_n} tokens in {s_t:.2f} s ({s_n / s_t:.0f} tok/s), "
              f"bare {b_n} tokens in {b_t:.2f} s ({b_n / b_t:.0f} tok/s)", flush=True)
    engine.close()
    s, b = statistics.median(stage), statistics.median(bare)
    result = {"target": str(target), "chats": args.chats, "rounds": len(rec.rounds),
              "requests": sum(len(r) for r in rec.rounds), "max_new_tokens": args.max_new_tokens,
              "stage_tok_s": round(s, 1), "bare_tok_s": round(b, 1), "ratio": round(s / b, 4),
              "overhead_pct": round(100 * (1 - s / b), 2)}
    print(json.dumps(result))
    print(f"stage 00: {s:.0f} generated tok/s vs bare LLM.generate {b:.0f} tok/s (median of {args.passes}): "
          f"ratio {s / b:.3f}, overhead {100 * (1 - s / b):.1f}% (goal < 5%)")


if __name__ == "__main__":
    main()

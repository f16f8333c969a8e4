"""Stage 06's single-stream timing: which engine serves which timed prompt when, and the loop
that serves them with an injected clock.

Why interleaved: a speedup is a ratio of two timings, and a machine shared with other work
slows down and speeds up on its own. Timed one configuration after the other (all plain
requests, then all drafted ones), a slowdown during one of them is read as the drafter's
doing: a demo beside other jobs measured plain 5.02 tokens/s, 21.0 with the drafter and
printed "4.2x: faster". Two orders (--timing-order):

- `pairs` (the default): both engines stay alive in one worker process
  (eagle3/stages/s06_evaluate/engine.py) and serve the timed prompts in pairs, each prompt
  once on each engine, back to back, which one goes first alternating from prompt to prompt
  and from pass to pass (a first request after a switch may pay for caches the other
  engine evicted; neither side always pays). A slowdown longer than one pair (a few
  seconds) hits both halves of the pairs it spans and cancels in each pair's ratio.
- `passes`: for a target that cannot be served twice at once (Kimi-K2.5 at tensor parallel
  8 fills most of each GPU), one engine at a time, a whole pass per engine, the engines
  restarted between them in the order plain, trained, trained, plain, ... (each engine
  goes first in every other pass, so a steady drift cancels in the sum). A slowdown
  during one engine's pass is not cancelled; it makes that pass disagree with the others.

What pairing cannot cancel, load that keeps time with the switches between engines, shows
as passes that disagree. Every pass serves the same prompts, greedy, to the same outputs:
identical work, so the passes' speedups (and break-evens) must agree. When they do not
(figures.py, `MAX_PASS_DISAGREEMENT`), stage 06 reports "timings unreliable: no verdict"
and no speedup, no break-even (report.py).

A block is one timed prompt served once on one engine; `schedule` and `pass_segments` order
the blocks, `serve_blocks` serves them through `serve(run, prompt) -> record`, reading
`clock` before and after each, and groups the records into each run's passes in the form
figures.py's `timing_pass` reads. No engine and no vLLM import here: the tests drive the
loop with a fake engine and a fake clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

PLAIN = "plain"  # the run without a drafter, as run.py names it


@dataclass(frozen=True)
class Block:
    """One timed request: prompt `prompt` (an index into the run's prompts) served once by
    engine `run` in timing pass `timing_pass`."""
    timing_pass: int
    prompt: int
    run: str


def schedule(timed: Sequence[int], passes: int, runs: Sequence[str]) -> list[Block]:
    """The order of the timed requests: for each pass, for each timed prompt, one request on
    each engine back to back; the first engine of a pair alternates with the prompt and the
    pass (pair j of pass n in the order of `runs` when n + j is even, reversed when odd)."""
    assert len(runs) == 2, f"timing pairs two engines, got {list(runs)}"  # the stage plans plain + trained
    blocks = []
    for n in range(passes):
        for j, i in enumerate(timed):
            order = runs if (n + j) % 2 == 0 else list(reversed(runs))
            blocks += [Block(n, i, run) for run in order]
    return blocks


def pass_segments(passes: int, runs: Sequence[str]) -> list[tuple[str, list[int]]]:
    """The `passes` order: (engine, its passes) for each engine start, one engine at a time.
    Pass n serves `runs` in order when n is even, reversed when odd, and an engine that serves
    the end of one pass and the start of the next keeps running: for 2 passes, plain [0],
    trained [0, 1], plain [1]."""
    segments: list[tuple[str, list[int]]] = []
    for n in range(passes):
        for run in (runs if n % 2 == 0 else list(reversed(runs))):
            if segments and segments[-1][0] == run:
                segments[-1][1].append(n)
            else:
                segments.append((run, [n]))
    return segments


def _empty_pass() -> dict[str, list]:
    return {"prompts": [], "request_start_s": [], "request_wall_s": [], "tokens": [], "token_ts": [],
            "histograms": []}


def serve_blocks(blocks: Sequence[Block], serve: Callable[[str, int], Mapping[str, Any]],
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, list[dict]]:
    """Serve `blocks` in order; per run, its passes in the form `figures.timing_pass` reads.

    `serve(run, prompt)` serves one request and returns its record: `tokens` (the output's
    token ids), `token_ts` (the engine's timestamps of its first and last token) and
    `histogram` (accepted drafts per verification step; None without a drafter). A request's
    wall time is `clock()` after it minus `clock()` before it. A pass's `wall_s` is the sum of
    its requests' walls (the other engine's requests fall between them).
    """
    passes: dict[str, dict[int, dict[str, list]]] = {}
    for block in blocks:
        start = clock()
        record = serve(block.run, block.prompt)
        wall = clock() - start
        p = passes.setdefault(block.run, {}).setdefault(block.timing_pass, _empty_pass())
        p["prompts"].append(block.prompt)
        p["request_start_s"].append(start)
        p["request_wall_s"].append(wall)
        p["tokens"].append(list(record["tokens"]))
        p["token_ts"].append(list(record["token_ts"]))
        p["histograms"].append(record.get("histogram"))
    out: dict[str, list[dict]] = {}
    for run, by_pass in passes.items():
        out[run] = []
        for n in sorted(by_pass):
            p = by_pass[n]
            if any(h is None for h in p["histograms"]):
                p["histograms"] = None  # the plain engine drafts nothing
            out[run].append({"timing_pass": n, **p, "wall_s": sum(p["request_wall_s"])})
    return out

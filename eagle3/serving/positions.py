"""How far into the served context a drafter was trained, and with which rope.

A drafter is trained on rows of at most `max_seq_len` tokens; draft step k of position t
sits at position t + k (docs/CONVENTIONS.md §8), so the last position any training step
saw is `max_seq_len - 1 + ttt_steps - 1`. The engines serve it over the target's whole
context (262,144 positions for Kimi-K2.5), with the rope its config.json names (the
target's yarn for K2.5, as stage 04 trains it: eagle3/drafter/model.py `rope_inv_freq`).
Positions past the trained ones are served without having been trained: stage 05 and
stage 06 say how many (docs/KIMI_K25.md, "Rope and length as served").
"""
from __future__ import annotations

from typing import Any, Mapping


def rope_text(rope_scaling: Mapping[str, Any] | None, rope_theta: float | None = None) -> str:
    """One phrase for a rope setting as config.json holds it."""
    theta = f"theta {rope_theta:g}" if rope_theta else "default theta"
    if not rope_scaling:
        return f"plain rope ({theta})"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    orig = rope_scaling.get("original_max_position_embeddings")
    return (f"{kind} rope ({theta}, factor {rope_scaling.get('factor')}"
            + (f", original {orig} positions" if orig else "") + ")")


def position_reach(*, max_seq_len: int, ttt_steps: int, served_context: int,
                   rope_scaling: Mapping[str, Any] | None = None, rope_theta: float | None = None) -> dict[str, Any]:
    """The longest position trained against the context the target serves."""
    longest = int(max_seq_len) - 1 + int(ttt_steps) - 1
    return {"longest_trained_position": longest, "max_seq_len": int(max_seq_len), "ttt_steps": int(ttt_steps),
            "served_context": int(served_context),
            "trained_share": round((longest + 1) / served_context, 4) if served_context else None,
            "rope": rope_text(rope_scaling, rope_theta), "rope_scaling": dict(rope_scaling) if rope_scaling else None}


def reach_line(r: Mapping[str, Any]) -> str:
    """The sentence stages 05 and 06 log for `position_reach`."""
    n, ctx = r["longest_trained_position"], r["served_context"]
    line = (f"the drafter was trained at positions 0-{n:,} (max_seq_len {r['max_seq_len']:,}, ttt_steps "
            f"{r['ttt_steps']}) with {r['rope']}, as config.json gives it to the engines")
    if ctx and ctx > n + 1:
        line += (f"; the target serves {ctx:,} positions: {100 * (n + 1) / ctx:.1f}% of them were trained, "
                 f"positions past {n:,} are served untrained (raise max_seq_len to train longer turns)")
    elif ctx:
        line += f"; the target serves {ctx:,} positions, all within the trained ones"
    return line

"""Stage 04's words at the end of a run and the run config its trackers record.

`end_of_run_lines`: one block, rounded to the digits that mean something
(eagle3/core/readable.py): the best held-out step, its figures, the last evaluation, and
the checkpoint stage 05 will export. `run_config`: what a tracker stores as the run's
config (the stage's parameters, the identities of the store and vocab it trained on,
the drafter's shape). Pure functions; run.py logs and passes them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from eagle3.artifacts.workdir import WorkDir
from eagle3.core import readable


def all_settings(cfg) -> dict:
    """Every field of the stage's config (paths as strings), identity or not."""
    return {f.name: (str(v) if isinstance(v, Path) else v)
            for f in dataclasses.fields(cfg) for v in [getattr(cfg, f.name)]}


def run_config(params: dict, identity: str, inputs: dict, drafter_config: dict, aux_layers: list[int],
               processes: int, all_params: dict) -> dict:
    """The run's config for the trackers: identity fields first, then every setting."""
    return {"identity": identity, "inputs": inputs, "params": params, "settings": all_params,
            "drafter_config": drafter_config, "aux_layer_ids": list(aux_layers), "processes": processes}


def _figures(metrics: dict | None, K: int) -> str:
    if not metrics:
        return "no held-out figures"
    acc = [metrics.get(f"full_acc_{k}") for k in range(K)]
    sampled = ""
    if metrics.get("sample_accept_length") is not None:
        probs = " ".join(readable.fixed(metrics.get(f"accept_prob_{k}"), 3) for k in range(K))
        sampled = (f"; under sampling {readable.num(metrics['sample_accept_length'])} (acceptance per step {probs}, the "
                   f"target's mass outside the draft vocabulary counted as rejected)")
    return (f"expected accept length {readable.num(metrics.get('expected_accept_length'))} "
            f"(1 + full_acc {' + '.join(readable.fixed(a, 3) for a in acc)}){sampled}, "
            f"loss_0 {readable.num(metrics.get('loss_0'))}, {readable.count(metrics.get('num_valid'))} held-out positions")


def end_of_run_lines(workdir: WorkDir, steps: int, K: int, best: dict, last_eval: dict | None,
                     last_eval_step: int, init_from: str | None) -> list[str]:
    """The block stage 04 logs when a run ends."""
    best_path = workdir.best_checkpoint()
    lines = [f"stage 04 finished: {readable.count(steps)} steps, K = {K} train-time-test steps; curves in "
             f"{workdir.train_metrics()}",
             f"  best held-out step {best.get('step')}: {_figures(best.get('metrics'), K)}"]
    if last_eval is not None and last_eval_step != best.get("step"):
        lines.append(f"  last held-out step {last_eval_step}: {_figures(last_eval, K)}")
    origin = (f"the initial weights of {init_from} (no trained step beat them)" if best.get("step") == 0 and init_from
              else f"step {best.get('step')}")
    lines.append(f"  the exported drafter will come from {best_path} ({origin}): `python {WorkDir.script('export')} "
                 f"--work-dir {Path(workdir.root)} --target-model TARGET` exports it (its default --checkpoint)")
    return lines

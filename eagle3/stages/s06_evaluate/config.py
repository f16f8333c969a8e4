"""Stage 06's config: which drafter, which prompts, what is measured, how the engines run.

Filled from the shared YAML keys, the `evaluate:` section and flags (eagle3/core/config.py).
The engine's settings (dtype, memory, eager, ...) are eagle3/engines/config.py's
`EngineSettings`, shared with stages 00 and 02.
Fields with `identity=False` change how the engines run, not what is measured, so a
finished measurement is not redone when only they change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from eagle3.core.config import param
from eagle3.core.errors import PipelineError
from eagle3.engines.config import EngineConfig, EngineSettings

# The orders of the timed requests (eagle3/stages/s06_evaluate/timing.py).
TIMING_ORDERS = ("pairs", "passes")
# --selection-prompts' name for stage 01's eval split (the conversations stage 04 evaluates on).
EVAL_SPLIT = "eval-split"


@dataclass(kw_only=True)
class EvaluateConfig(EngineSettings):
    work_dir: Path = param(help="work directory (stage 05 must have run in it, and stage 01 unless --prompts; with "
                                "--drafter-dir and --prompts any folder, even a new one)")
    target_model: str = param(help="target model folder or hub id to serve (the one stage 02 extracted from)")
    drafter_dir: Path | None = param(None, help="drafter folder to measure (default: stage 05's export)")
    num_speculative_tokens: int = param(3, min=1, help="K: tokens the drafter proposes per step")
    # -- what is asked ------------------------------------------------------------------------
    prompts: str | None = param(None, help="prompt set: a local .json/.jsonl file (OpenAI `messages`, ShareGPT "
                                           "`conversations`, a `prompt` / `instruction` / `question` field, MT-Bench "
                                           "`turns`, or see --prompt-field) or a datasets id (see --prompts-split); "
                                           f"default, or `{EVAL_SPLIT}` (to override a config's file): every "
                                           "assistant turn of stage 01's eval split")
    prompts_split: str = param("test", help="split of a datasets id given with --prompts")
    prompt_field: str | None = param(None, help="the field of --prompts records holding the prompt, read instead "
                                                "of any other (default: messages, conversations, prompt, "
                                                "instruction, question, turns; a list of user turns uses the first)")
    category_field: str | None = param(None, help="column of --prompts records that groups them (e.g. `category` "
                                                  "for MT-Bench); acceptance is reported per group")
    num_prompts: int | None = param(None, min=1, help="serve only the first N prompts (None: all); acceptance is "
                                               "measured over all of them at once")
    temperature: list[float] = param(default_factory=lambda: [0.0, 0.7], min=0.0,
                                     help="sampling temperature(s) acceptance is measured at, comma-separated; "
                                          "0 is greedy; the first one gives the headline figures")
    max_new_tokens: int = param(64, min=1, help="cap on generated tokens per prompt (generation also stops at EOS)")
    timing_prompts: int = param(8, min=0, help="prompts timed single-stream (one request at a time, greedy) for "
                                        "tokens/s, speedup and break-even; both engines (plain, drafter) then live "
                                        "in one process, each with its KV cache; 0 skips timing")
    max_num_seqs: int = param(64, min=1, help="concurrent sequences in the acceptance passes (acceptance does not "
                                       "depend on it; timing is always single-stream)")
    baseline_untrained: bool = param(True, help="also serve an untrained drafter of the same shape (the floor)")
    select_checkpoint: bool = param(False, identity=False,
                                    help="first serve each checkpoint stage 04 kept (--keep-evaluated N > 1) greedy "
                                         "on these prompts, acceptance only, and have stage 05 export the one served "
                                         "best (its model card says how it was chosen); then measure it as usual")
    selection_prompts: str | None = param(None, identity=False,
                                          help=f"the prompts --select-checkpoint compares the checkpoints on: "
                                               f"`{EVAL_SPLIT}` (every assistant turn of stage 01's eval split) or a "
                                               f"file / datasets id as for --prompts; default: the prompts measured "
                                               f"after it, which makes the chosen one's measured figure an "
                                               f"optimistic estimate (the best of N on the same prompts)")
    seed: int = param(0, help="engine seed, per-request sampling seeds (seed + prompt index) and the "
                              "untrained drafter's initialisation")
    # -- how the engines run (not part of what is measured) --------------------------------
    warmup_prompts: int = param(1, min=0, identity=False, help="short single-stream requests served before timing "
                                                        "(first-call costs)")
    timed_passes: int = param(2, min=2, identity=False, help="passes over the timing subset on both engines; the "
                                                      "passes do identical work, so their speedups must agree "
                                                      "or the timings give no verdict (other load on the "
                                                      "machine)")
    timing_order: str = param("pairs", choices=TIMING_ORDERS, identity=False,
                              help="pairs: both engines alive in one process, each timed prompt served without and "
                                   "with the drafter back to back (a slowdown of the machine hits both); passes: "
                                   "one engine at a time, whole passes in the order plain, trained, trained, "
                                   "plain, ... (for a target too large to serve twice at once; one more engine "
                                   "start)")
    # On by default, unlike stages 00 and 02: each engine runs in a worker process of its own
    # (engine.py), so no long-lived caller inherits the engine's thread pinning, and the CPU
    # build's sampled-verification fix (engine.py) patches the engine core only in this process.
    engine_in_process: bool = param(True, identity=False, help="run vLLM's engine core in the worker "
                                                               "process (VLLM_ENABLE_V1_MULTIPROCESSING=0; "
                                                               "faster start on CPU)")
    timeout_s: int = param(1800, min=1, identity=False, help="seconds one engine run may take")
    take_over_stale_s: float | None = param(None, min=0.0, identity=False, help="take over 06_evaluate from a "
                                            "measurement on another box whose heartbeat has not changed for this "
                                            "many seconds, watched from here (at least 90). Default: never; one "
                                            "whose process is gone on this machine is replaced without it")

    def __post_init__(self):
        super().__post_init__()  # the choices and ranges declared with the fields; dtype's one spelling
        self.temperature = [float(t) for t in self.temperature]
        if self.prompts == EVAL_SPLIT:  # the default spelled out, so a command can undo a config's prompt file;
            self.prompts = self.prompt_field = self.category_field = None  # that file's fields go with it
        if not self.temperature or len(set(self.temperature)) != len(self.temperature):
            raise PipelineError(f"evaluate.temperature = {self.temperature}: give one or more distinct values >= 0 "
                                f"(--temperature 0,0.7; 0 is greedy).")
        if self.select_checkpoint and self.drafter_dir is not None:
            raise PipelineError(f"--select-checkpoint exports the chosen checkpoint of this work dir's stage 04 into "
                                f"stage 05's folder; --drafter-dir {self.drafter_dir} names another drafter: pass "
                                f"one of them.")
        if self.selection_prompts is not None and not self.select_checkpoint:
            raise PipelineError(f"--selection-prompts {self.selection_prompts} chooses the prompts of "
                                f"--select-checkpoint, which is off: pass --select-checkpoint too, or drop it.")
        if self.selection_prompts is not None and self.selection_prompts == (self.prompts or EVAL_SPLIT):
            raise PipelineError(f"--selection-prompts {self.selection_prompts} are the prompts measured after the "
                                f"selection too; that is the default (an optimistic figure): drop the flag, or name "
                                f"another set (`{EVAL_SPLIT}` or a prompt file) to choose on.")
        if self.category_field and not self.prompts:
            raise PipelineError(f"--category-field {self.category_field} needs a prompt set (--prompts FILE or "
                                f"DATASET_ID); stage 01's eval split has no categories.")

    def selection_config(self) -> EvaluateConfig:
        """This config with --select-checkpoint's prompts in place of the measured ones (itself
        when they are the same); --num-prompts caps both sets."""
        if self.selection_prompts is None:
            return self
        prompts = None if self.selection_prompts == EVAL_SPLIT else self.selection_prompts
        return replace(self, prompts=prompts, prompt_field=None, category_field=None, selection_prompts=None)

    def engine_config(self, **stage_specific) -> EngineConfig:
        """Stage 06's engine: the shared settings, its batch limit and its seed (engine.py adds
        each run's drafter and what measuring needs of any engine)."""
        return super().engine_config(**{"max_num_seqs": self.max_num_seqs, "seed": self.seed, **stage_specific})

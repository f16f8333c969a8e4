"""Stage 06: measure the exported drafter in a real engine (vLLM), as users benchmark it.

`evaluate_drafter(EvaluateConfig(...))` is the stage (run.py, where its steps read top to
bottom). Modules, one concern each:

    config.py   EvaluateConfig
    prompts.py  what the target is asked: stage 01's held-out turns or a prompt set
    engine.py   the engine runs, one process each (the only module importing vllm)
    figures.py  engine results -> acceptance and timing figures (pure functions)
    report.py   results.json's layout, the report lines and the plot
    run.py      the stage: inputs, checks, the plan of engine runs, the outputs
"""
from ..workdir import WorkDir
from .config import EvaluateConfig
from .figures import timing_problems
from .prompts import Prompt, assistant_turns, file_prompts, held_out_prompts
from .report import report_lines, summarise
from .run import evaluate_drafter, training_expectation, write_untrained_drafter

# The names of the two outputs inside WORK/06_evaluate/, for callers of the former module
# (WorkDir owns them: wd.evaluate_results(), wd.evaluate_plot()).
RESULTS_JSON = WorkDir(".").evaluate_results().name
PLOT_PNG = WorkDir(".").evaluate_plot().name

__all__ = ["EvaluateConfig", "evaluate_drafter", "Prompt", "assistant_turns", "held_out_prompts", "file_prompts",
           "report_lines", "summarise", "timing_problems", "training_expectation", "write_untrained_drafter", "RESULTS_JSON",
           "PLOT_PNG"]

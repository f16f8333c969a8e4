"""Stage 06: measure the exported drafter in a real engine (vLLM), as users benchmark it.

`evaluate_drafter(EvaluateConfig(...))` is the stage (run.py, where its steps read top to
bottom). Modules, one concern each:

    config.py   EvaluateConfig
    prompts.py  what the target is asked: stage 01's held-out turns or a prompt set
    engine.py   the engine runs, one process each (the only module importing vllm)
    timing.py   the interleaved timing: which engine serves which timed prompt when (clock injected)
    figures.py  engine results -> acceptance and timing figures (pure functions)
    report.py   results.json's layout, the report lines and the plot
    run.py      the stage: inputs, checks, the plan of engine runs, the outputs
"""

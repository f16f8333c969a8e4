"""The plumbing every other package may use: nothing in it knows a model, an artifact or an engine.

    config.py    the typed stage configs' machinery: YAML sections, flags, checks
    cli.py       the numbered scripts' command line (`run_stage`)
    stages.py    the stage registry: keys, folders, scripts, in order
    logs.py      logging: one format, rank 0 only, a stage's log file, quiet third-party loggers
    errors.py    PipelineError, the one exception a user reads
    readable.py  figures rounded for people (pure; logs, reports, the model card, the demo)
    batching.py  samples grouped into batches by token count (pure; stages 02 and 04)

Imports: core only. The one exception is cli.py, above the artifacts: it opens the stage's
run record (eagle3/artifacts/manifest.py `stage_run`) and its log file (the work dir), and
nothing below it imports it (tests/unit/test_layout.py holds these rules).
"""

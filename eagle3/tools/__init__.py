"""The operator's commands beside the numbered scripts, for runs on real targets.

    diagnose/        `python -m eagle3.tools.diagnose ...`: inspect a drafter folder, engine
                     parity, compare vocabularies, probe hidden states, versions, store size,
                     forecast
    forecast.py      how much data reaches a target acceptance (`diagnose forecast`)
    parity/          a drafter as vLLM's and SGLang's own classes serve it (`diagnose parity`)
    check_stores.py  two stage-02 stores compared row by row, and against transformers
    window_loop.py   extract and train round by round on one box, within a disk budget

The demo's targets, chats and summary are eagle3/demo/, which no tool imports. Imports:
anything else of ours; nothing outside eagle3/tools/ imports a tool (tests/unit/test_layout.py).
"""

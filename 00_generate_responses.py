"""Stage 00: regenerate every assistant turn with the target itself (vLLM), token-exact.

    python 00_generate_responses.py --config configs/tiny-llama.yaml [--temperature 0] [--max-new-tokens 256]
    python 00_generate_responses.py --config configs/kimi-k2.5.yaml --tensor-parallel-size 8 --num-shards 4 --shard-index 0

Writes WORK/00_generate/ (see eagle3/stages/s00_generate/run.py); stage 01 reads it with `--data generated`.
"""
if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    from eagle3.core.cli import run_stage
    from eagle3.stages.configs import STAGE_CONFIGS
    from eagle3.stages.s00_generate.config import GenerateConfig
    from eagle3.stages.s00_generate.run import generate_responses

    run_stage(GenerateConfig, "generate", generate_responses, __doc__, sections=STAGE_CONFIGS)

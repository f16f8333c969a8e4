"""Stage 06: measure the exported drafter in a real engine (vLLM), as users benchmark it.

    python 06_evaluate_drafter.py --config configs/tiny-llama.yaml [--num-speculative-tokens 3]
    python 06_evaluate_drafter.py --config configs/kimi-k2.5.yaml --tensor-parallel-size 8 --drafter-dir DIR \\
        --prompts mt_bench.jsonl --prompt-field turns --category-field category

Serves the target alone, with the drafter, and with an untrained drafter of the same
shape. Acceptance (mean, 95% interval over prompts, per draft position, per category)
is measured over all prompts at once, at each --temperature (default greedy and 0.7);
tokens/s, the speedup and the break-even acceptance length single-stream on a subset
of --timing-prompts prompts, the plain and the drafter's requests interleaved (passes that
disagree give "timings unreliable: no verdict"). Prompts: stage 01's held-out turns, or a file / datasets
id (--prompts). Writes WORK/06_evaluate/results.json, evaluate.png and the manifest
(see eagle3/stages/s06_evaluate/).
"""
if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    from eagle3.core.cli import run_stage
    from eagle3.stages.configs import STAGE_CONFIGS
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    run_stage(EvaluateConfig, "evaluate", evaluate_drafter, __doc__, sections=STAGE_CONFIGS)

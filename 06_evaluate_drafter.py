"""Stage 06: measure the exported drafter in a real engine (vLLM) against plain decoding.

    python 06_evaluate_drafter.py --config configs/tiny-llama.yaml [--num-speculative-tokens 3]
    python 06_evaluate_drafter.py --config configs/kimi-k2.5.yaml --tensor-parallel-size 8 --drafter-dir DIR

Serves the target alone, with the drafter, and with an untrained drafter of the same
shape, greedy, on held-out prompts from stage 01; reports the acceptance length (mean
and per draft position) beside the training-time expectation, tokens/s with and without
the drafter, the speedup and the break-even acceptance length. Writes
WORK/06_evaluate/results.json, evaluate.png and the manifest (see eagle3/evaluate.py).
"""
from eagle3.cli import run_stage
from eagle3.evaluate import EvaluateConfig, evaluate_drafter

if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    run_stage(EvaluateConfig, "evaluate", evaluate_drafter, __doc__)

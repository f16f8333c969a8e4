"""Stage 05: export a trained drafter as config.json + model.safetensors for SGLang and vLLM.

    python 05_export_drafter.py --config configs/tiny-llama.yaml [--checkpoint PATH] [--out-dir DIR]

Writes the drafter folder (default WORK/05_export), an export report (export_report.json
and .md: layers each engine captures, vocab coverage, expected accept length) and the
stage manifest. Check any drafter folder with `python -m eagle3.tools.diagnose inspect DIR`.
"""
from eagle3.core.cli import stage_main

if __name__ == "__main__":
    stage_main("export", __doc__)

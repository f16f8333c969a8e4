"""Stage 05: export a trained drafter as config.json + model.safetensors for SGLang and vLLM.

    python 05_export_drafter.py --config configs/tiny-llama.yaml [--checkpoint PATH] [--out-dir DIR]

Writes the drafter folder (default WORK/05_export), an export report (export_report.json
and .md: layers each engine captures, vocab coverage, expected accept length) and the
stage manifest. Check any drafter folder with `python -m eagle3.tools.diagnose inspect DIR`.
"""
from eagle3.core.cli import run_stage
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s05_export.config import ExportConfig
from eagle3.stages.s05_export.run import export_drafter

if __name__ == "__main__":
    run_stage(ExportConfig, "export", export_drafter, __doc__, sections=STAGE_CONFIGS)

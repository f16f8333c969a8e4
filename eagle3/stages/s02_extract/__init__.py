"""Stage 02: hidden-state extraction (target forward passes -> the hidden-state store).

`run.extract_hidden_states(config.ExtractConfig(...))` is the stage; backends: `hf_backend`
(transformers) and `vllm_backend` (+ `vllm_connector`, the only modules importing
vllm, loaded lazily). The store format, writer and reader live in eagle3/artifacts/store/.
"""

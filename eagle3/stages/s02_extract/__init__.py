"""Stage 02: hidden-state extraction (target forward passes -> the hidden-state store).

`run.extract_hidden_states(config.ExtractConfig(...))` is the stage: the whole store, or
windows under --disk-budget (`windowed`). The steps both take, each in its own module:
`inputs` (checks before any model loads, stage 01's splits), `plan` (the store's files and
each box's), `engine` (backend and target head), `write` (the files), `results` (index and
manifest). Backends: `hf_backend` (transformers) and `vllm_backend` (+ `vllm_connector`, the
only modules importing vllm, loaded lazily). The store format, writer and reader live in
eagle3/artifacts/store/.
"""

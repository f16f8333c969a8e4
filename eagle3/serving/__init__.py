"""The serving format: what SGLang's and vLLM's loaders require of a drafter folder, its writer and reader, the engine version table, the model card."""

"""Stage 00's config: which target, how to sample, how to split the work.

Filled from the shared YAML keys, the `generate:` section and flags (eagle3/core/config.py).
The engine's settings (dtype, memory, eager, ...) are eagle3/engines/config.py's
`EngineSettings`, shared with stages 02 and 06. Fields with `identity=False` change how
the work is done, not what is generated, so finished chunks are not redone when only
they change.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from eagle3.core.config import ShardedStageConfig, data_sources, param
from eagle3.core.errors import PipelineError
from eagle3.engines.config import EngineConfig, EngineSettings


@dataclass(kw_only=True)
class GenerateConfig(EngineSettings, ShardedStageConfig):
    target_model: str = param(help="target model folder or hub id: the model the drafter will serve with")
    data: list[str] = param(help="chats or prompts: .json/.jsonl files (OpenAI `messages`, ShareGPT "
                                 "`conversations`, a `prompt` / `instruction` / `question` field or MT-Bench "
                                 "`turns`) or datasets ids; user turns without an answer get one")
    data_split: str = param("train", help="split to read from datasets ids")
    prompt_field: str | None = param(None, help="the record field holding the prompt: a string (one user turn), "
                                                "a list of strings (user turns) or a list of turns (default: "
                                                "messages, conversations, prompt, instruction, question, turns)")
    chat_template_kwargs: dict | None = param(None, help="JSON object passed to the chat template, e.g. "
                                                         "'{\"thinking\": false}' (stage 01 uses the same)")
    temperature: float = param(0.0, min=0.0, help="sampling temperature; 0 = greedy, which matches greedy serving")
    top_p: float = param(1.0, gt=0.0, max=1.0, help="nucleus sampling threshold (1 = off)")
    max_new_tokens: int = param(2048, min=1, help="cap on generated tokens per assistant turn; cut answers are "
                                           "counted and kept")
    seed: int = param(0, help="sampling seed; each request's seed derives from (seed, sample id, turn)")
    # Part of what is generated (identity, unlike the other stages' context length): a
    # conversation ends before the first turn whose prompt does not fit.
    max_model_len: int | None = param(None, min=1, help="context length; longer prompts are counted and their "
                                                        "conversation ends before that turn (default: the target's)")
    chunk_size: int = param(256, min=1, help="conversations per output chunk: the unit of resume, of multi-box "
                                      "splitting, and of batching (all turn-k prompts of a chunk go together)")
    # --- how the work is done (not part of what is generated) ---
    max_num_seqs: int = param(256, min=1, identity=False, help="vLLM: concurrent sequences per engine")
    force: bool = param(False, identity=False, help="start over: what this stage wrote (every box's chunks) is moved "
                                                       "aside to 00_generate.previous-TIME, not deleted")

    def __post_init__(self):
        self.data = data_sources(self.data, "generate")
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise PipelineError(f"--chat-template-kwargs {self.chat_template_kwargs!r} is not JSON ({e}); "
                                    f"e.g. --chat-template-kwargs '{{\"thinking\": false}}'.") from e
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise PipelineError(f"generate.chat_template_kwargs = {self.chat_template_kwargs!r} must be a JSON "
                                f"object, e.g. '{{\"thinking\": false}}'.")
        super().__post_init__()  # the choices and ranges declared with the fields; dtype's one spelling

    def engine_config(self, **stage_specific) -> EngineConfig:
        """Stage 00's engine: the shared settings, its batch limit and its seed (vllm_runner.py
        adds what generation needs of any engine)."""
        return super().engine_config(**{"max_num_seqs": self.max_num_seqs, "seed": self.seed, **stage_specific})

    @property
    def template_kwargs(self) -> dict:
        return dict(self.chat_template_kwargs or {})

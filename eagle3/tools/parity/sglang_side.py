"""SGLang's own EAGLE-3 drafter and Llama target classes, run outside a server on the CPU.

Runs in a worker process (eagle3/tools/parity/worker.py) with the SGLang environment's
python (`.venv-sglang`, scripts/setup_cpu.sh; `sglang==0.5.23` over the global torch and
transformers). What SGLang needs to build its layers in one process, as its own tests set
it up (sglang/test/layer_ut_utils.py `init_single_process_dist`, the attention test kit's
mock runner): `SGLANG_USE_CPU_ENGINE=1`, the import stubs of eagle3/tools/parity/sglang_stubs.py,
a one-rank gloo process group with SGLang's model-parallel groups (`publish_build_topology`,
`initialize_model_parallel`), and `get_context().override_server_args(tp_size=1,
attention_backend="torch_native", device="cpu", enable_deterministic_inference=True)`. The last
one matters to DeepSeek targets only: their prefill otherwise takes the per-head MHA path
(models/deepseek_common/attention_backend_handler.py `handle_attention_triton`, the handler
torch_native falls back to), whose keys the torch-native backend reads back from the MLA pool
as 576-wide latents and stops ("Expected size for first two dimensions of batch2 tensor to
be: [4, 128] but got: [4, 576]", torch_native_backend.py `_run_sdpa_forward_extend`);
deterministic inference selects the absorbed MLA path, which that pool serves. Then, per case:

- the drafter's config through SGLang's own reader (srt/utils/hf_transformers/config.py
  `get_config`), `LlamaForCausalLMEagle3(config)` (models/llama_eagle3.py) and its own
  `load_weights`; its `hot_token_id` is the draft -> target map its EAGLE worker applies
  to each proposal (speculative/eagle_worker_v2.py);
- attention through RadixAttention on `TorchNativeAttnBackend` (layers/attention/
  torch_native_backend.py) with a `ReqToTokenPool` and an `MHATokenToKVPool`
  (mem_cache/memory_pool.py), one `ForwardBatch` per step (EXTEND for the prefix, DECODE for
  each further step), under SGLang's `forward_context`; the aux states reach the model as
  its EAGLE worker hands them, `forward_batch.spec_info.hidden_states`;
- logits by its `LogitsProcessor._compute_lm_head` (what its `_get_logits` calls);
- the layers SGLang's target captures for this drafter: the nested
  `eagle_config.eagle_aux_hidden_state_layer_ids` its model runner reads
  (model_runner_components/spec_aux_hidden_state.py `_resolve_eagle_aux_hidden_state`)
  handed to each target class's own `set_eagle3_layers_to_capture` (models/llama.py for
  Llama-family targets; models/deepseek_v2.py for DeepSeek/Kimi ones).

`capture` runs SGLang's target class for a target folder (its registry's pick: models/llama.py
`LlamaForCausalLM`, models/deepseek_v2.py `DeepseekV3ForCausalLM` with an `MLATokenToKVPool`)
with aux-state capture, for the target-side parity (eagle3/tools/parity/capture.py). SGLang's
DeepSeek class on the CPU needs of the target's config what every released DeepSeek-V3/Kimi-K2
config has: a yarn `rope_scaling` (rotary_embedding/factory.py `get_rope_cpu` asserts one,
line 478), `moe_layer_freq` (deepseek_v2.py `_is_layer_sparse`), `scoring_func` and
`topk_method` (deepseek_v2.py `DeepseekV2MoE.__init__`).
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eagle3.tools.parity import protocol, sglang_stubs

_state: dict[str, Any] = {}


def setup() -> dict[str, Any]:
    """Import SGLang with its stubs and set up its one-process state (once); its version."""
    if _state:
        return _state
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's switch to its CPU paths
    stubbed = sglang_stubs.install()
    import sglang
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import get_context
    from sglang.test.test_utils import publish_build_topology

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ.get("EAGLE3_PARITY_PORT", "29741")  # the worker picks a free one
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    publish_build_topology(tp_size=1, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="gloo")
    override = get_context().override_server_args(tp_size=1, attention_backend="torch_native", device="cpu",
                                                  enable_deterministic_inference=True)
    override.install()
    _state.update(version=sglang.__version__, stubbed=list(stubbed), override=override)
    return _state


class _Pools:
    """SGLang's request-to-token and KV pools for a batch of requests, and its torch-native backend."""

    def __init__(self, requests: int, max_len: int, kv_heads: int, head_dim: int, layers: int = 1,
                 mla: tuple[int, int] | None = None) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

        self.max_len = max_len
        self.req_to_token = ReqToTokenPool(size=requests, max_context_len=max_len, device="cpu",
                                           enable_memory_saver=False)
        # slot 0 is SGLang's padding slot: real tokens start at 1
        size = 1 + requests * max_len
        if mla is not None:  # DeepSeek's latent KV: (kv_lora_rank, qk_rope_head_dim) per token and layer
            self.kv = MLATokenToKVPool(size=size, page_size=1, dtype=torch.float32, kv_lora_rank=mla[0],
                                       qk_rope_head_dim=mla[1], layer_num=layers, device="cpu",
                                       enable_memory_saver=False)
        else:
            self.kv = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                       head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                                       enable_alt_stream=False)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token, token_to_kv_pool=self.kv)
        self.backend = TorchNativeAttnBackend(runner)

    def slot(self, request: int, index: int) -> int:
        return 1 + request * self.max_len + index

    def batch(self, mode: str, seq_lens: list[int], new_lens: list[int], positions: torch.Tensor,
              hidden: torch.Tensor | None = None):
        """A ForwardBatch whose requests hold `seq_lens` tokens, the last `new_lens` of them new."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        for r, n in enumerate(seq_lens):
            self.req_to_token.req_to_token[r, :n] = torch.tensor([self.slot(r, i) for i in range(n)])
        new_slots = [self.slot(r, i) for r, (n, m) in enumerate(zip(seq_lens, new_lens)) for i in range(n - m, n)]
        R, T = len(seq_lens), sum(new_lens)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, batch_size=R,
            input_ids=torch.zeros(T, dtype=torch.int64), req_pool_indices=torch.arange(R, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            out_cache_loc=torch.tensor(new_slots, dtype=torch.int64), seq_lens_sum=sum(seq_lens), positions=positions)
        if mode == "extend":
            prefix = [n - m for n, m in zip(seq_lens, new_lens)]
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
            fb.extend_prefix_lens_cpu = prefix
            fb.extend_seq_lens = torch.tensor(new_lens, dtype=torch.int32)
            fb.extend_seq_lens_cpu = list(new_lens)
            fb.extend_num_tokens = T
        fb.attn_backend = self.backend
        if hidden is not None:
            fb.spec_info = SimpleNamespace(hidden_states=hidden)  # what SGLang's EAGLE worker hands its draft model
        self.backend.init_forward_metadata(fb)
        return fb


def _forward(model, fb, positions: torch.Tensor, embeds: torch.Tensor | None = None, input_ids=None):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fb.attn_backend), forward_batch=fb):
        ids = input_ids if input_ids is not None else fb.input_ids
        return model.model(ids, positions, fb, input_embeds=embeds)


def captured_layers(config, target_layers: int) -> dict[str, list[int]]:
    """What SGLang's Llama and DeepSeek target classes capture for this drafter config."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM

    eagle_config = getattr(config, "eagle_config", None)
    try:  # read as the model runner reads it; a missing key means None (the target's default)
        ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
    except Exception:  # noqa: BLE001 - the runner catches every error here the same way
        ids = None
    out = {}
    for rule, cls in (("sglang", LlamaForCausalLM), ("sglang-deepseek", DeepseekV2ForCausalLM)):
        stand_in = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                                   config=SimpleNamespace(num_hidden_layers=target_layers), model=SimpleNamespace())
        cls.set_eagle3_layers_to_capture(stand_in, list(ids) if ids is not None else None)
        out[rule] = [int(k) for k in stand_in.model.layers_to_capture]
    return out


def run_case(case: dict[str, Any], scratch: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One drafter folder through SGLang's class: K chained steps over the case's requests."""
    from safetensors.torch import load_file
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.utils.hf_transformers.config import get_config

    folder, chains, steps = Path(case["folder"]), case["chains"], int(case["steps"])
    inputs = load_file(case["inputs"])
    facts: dict[str, Any] = {"error": None}
    try:
        config = get_config(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - its config reader's refusal is the finding
        return {}, {"error": {"where": "config", "message": f"{type(e).__name__}: {e}"}}
    facts["captured"] = captured_layers(config, int(case["target_layers"]))
    torch.set_default_dtype(torch.float32)
    model = LlamaForCausalLMEagle3(config).eval()
    facts["built"] = protocol.built_shape(model.model)
    weights = load_file(str(folder / "model.safetensors"))
    try:
        model.load_weights(weights.items())
    except Exception as e:  # noqa: BLE001 - the loader's own refusal is the finding
        failing = {}
        for name, t in weights.items():
            try:
                LlamaForCausalLMEagle3(config).load_weights([(name, t)])
            except Exception as err:  # noqa: BLE001
                failing[name] = f"{type(err).__name__}: {err}"
        facts["error"] = {"where": "load_weights", "message": f"{type(e).__name__}: {e}", "tensors": failing}
        return {}, facts
    attn = model.model.layers[0].self_attn
    V_d = int(config.draft_vocab_size)
    out = {f"held.{k}": v for k, v in protocol.held_weights(
        dict(model.named_parameters()), attn.total_num_heads, attn.total_num_kv_heads, attn.head_dim, V_d).items()}
    hot = model.hot_token_id
    out["target_ids"] = hot.clone() if hot is not None else torch.arange(V_d)
    positions = protocol.rope_positions(chains, steps)
    out["rope"] = attn.rotary_emb.cos_sin_cache[positions].float()
    facts["rope_class"] = type(attn.rotary_emb).__name__

    def logits_and_ids(normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.logits_processor._compute_lm_head(normed, model.lm_head)[:, :V_d]  # [N, V_d] (pad dropped)
        if model.logits_processor.logit_scale is not None:
            logits = logits * model.logits_processor.logit_scale
        best = logits.argmax(-1)
        return logits, (hot[best] if hot is not None else best)

    try:
        _chain(model, chains, steps, inputs, logits_and_ids, out)
    except Exception as e:  # noqa: BLE001 - a forward the engine cannot run is the finding
        facts["error"] = {"where": "forward", "message": f"{type(e).__name__}: {e}"}
    return out, facts


def _chain(model, chains, steps, inputs, logits_and_ids, out: dict[str, torch.Tensor]) -> None:
    """K chained steps into `out` (logits.k, ids.k as each is computed)."""
    attn = model.model.layers[0].self_attn
    lengths = [length for length, _ in chains]
    pools = _Pools(len(chains), max(lengths) + steps, attn.num_kv_heads, attn.head_dim)
    pos = protocol.chain_positions(chains)
    fb = pools.batch("extend", lengths, lengths, pos, hidden=inputs["aux"].float())
    normed, (prenorm,) = _forward(model, fb, pos, inputs["embeds.0"].float())
    out["logits.0"], out["ids.0"] = logits_and_ids(normed)
    prev = prenorm[protocol.last_rows(chains)]
    for k in range(1, steps):
        pos = protocol.decode_positions(chains, k)
        fb = pools.batch("decode", [n + k for n in lengths], [1] * len(chains), pos, hidden=prev)
        normed, (prev,) = _forward(model, fb, pos, inputs[f"embeds.{k}"].float())
        out[f"logits.{k}"], out[f"ids.{k}"] = logits_and_ids(normed)


def check_import() -> str:
    """Import SGLang's drafter and target classes with the stubs; the line scripts/setup_sglang.sh prints."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    stubbed = sglang_stubs.install()
    import sglang
    import sglang.srt.models.deepseek_v2  # noqa: F401
    import sglang.srt.models.llama  # noqa: F401
    import sglang.srt.models.llama_eagle3  # noqa: F401

    return f"sglang {sglang.__version__} imports its EAGLE-3 classes on torch {torch.__version__} (stubs: " \
           f"{', '.join(stubbed) or 'none'})"


if __name__ == "__main__":  # `python -m eagle3.tools.parity.sglang_side --check` (scripts/setup_sglang.sh)
    import sys

    if sys.argv[1:] != ["--check"]:
        sys.exit("usage: python -m eagle3.tools.parity.sglang_side --check")
    sys.stdout.write(check_import() + "\n")


def capture(job: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """SGLang's own target class on a target folder, capturing aux states as it serves a drafter.

    The class is the one SGLang's registry picks for the target's architecture (models/
    registry.py); the layers are what its `set_eagle3_layers_to_capture` makes of the drafter
    config's nested ids; the samples (`ids.i`) run as one EXTEND batch through RadixAttention on
    the torch-native backend. Returns captured.j [T_all, H] per captured layer (in capture order)
    and final [T_all, H] (the normed output), samples one after another.
    """
    from safetensors.torch import load_file
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.utils.hf_transformers.config import get_config

    target = Path(job["target"])
    facts: dict[str, Any] = {"error": None}
    try:
        config = get_config(str(target), trust_remote_code=False)
        cls, arch = ModelRegistry.resolve_model_cls(config.architectures)
        torch.set_default_dtype(torch.float32)
        model = cls(config).eval()
        weights = {}
        for f in sorted(target.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        model.load_weights(((k, v.float() if v.is_floating_point() else v) for k, v in weights.items()))
        model.set_eagle3_layers_to_capture(job["nested_ids"])
        facts.update(architecture=arch, layers_to_capture=[int(k) for k in model.model.layers_to_capture])
        samples = load_file(job["samples"])
        ids = [samples[f"ids.{i}"].long() for i in range(len(samples))]
        lengths = [len(x) for x in ids]
        text = getattr(config, "text_config", config)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        mla = (int(text.kv_lora_rank), int(text.qk_rope_head_dim)) if getattr(text, "kv_lora_rank", None) else None
        pools = _Pools(len(ids), max(lengths), getattr(text, "num_key_value_heads", heads), head_dim,
                       layers=text.num_hidden_layers, mla=mla)
        positions = torch.cat([torch.arange(n) for n in lengths])
        fb = pools.batch("extend", lengths, lengths, positions)
        final, aux = _forward(model, fb, positions, input_ids=torch.cat(ids))
    except Exception as e:  # noqa: BLE001 - what stops SGLang's target here is the finding
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        where = next((f for f in reversed(frames) if "sglang" in f.filename), frames[-1])
        facts["error"] = {"where": "capture", "message": f"{type(e).__name__}: {e}",
                          "at": f"{where.filename}:{where.lineno} ({where.name})"}
        return {}, facts
    hidden = final.shape[-1]
    # the Llama class returns a list, one [T, H] per layer; DeepSeek's packs them [T, A*H]
    # (layers/aux_hidden_states.py `AuxHiddenStatePacker`)
    parts = [p for a in (aux if isinstance(aux, (list, tuple)) else [aux]) for p in a.split(hidden, dim=-1)]
    out = {f"captured.{j}": a.float() for j, a in enumerate(parts)}
    out["final"] = final.float()
    return out, facts

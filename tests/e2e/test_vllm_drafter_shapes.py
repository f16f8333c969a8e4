"""The drafter shapes (eagle3 and EAGLE 3.1) against vLLM 0.32's own `Eagle3LlamaForCausalLM`.

Stage 05's folder is handed to vLLM as it would be served: `EngineArgs(speculative_config=...)`
builds the draft config from its config.json, vLLM's class is built under that config and
loads the file with its own `load_weights` (which raises on a tensor name it does not know),
then one draft step runs through vLLM's forward (`combine_hidden_states`, then the model:
vLLM's norms, MLP, final norm and the state it feeds the next step) and through
eagle3/drafter/model.py on the same inputs. Only the paged attention kernel is replaced,
by plain causal attention over the step's positions (what it computes for a prefill), because
it needs an engine's cache and metadata; everything around it is vLLM's code. The draft step
of an EAGLE 3.1 drafter must match: fc_norm on each aux layer, the post-norm state fed on.

Imports vLLM (about 20 s on 2 cores) and sets up a one-process gloo group; starts no engine.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.shape import SHAPES
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.serving.drafter_io import WEIGHTS_NAME, hf_config_from_drafter_config, save_drafter_dir

pytest.importorskip("vllm")
from vllm.config import CompilationMode, set_current_vllm_config  # noqa: E402
from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,  # noqa: E402
                              init_distributed_environment, initialize_model_parallel)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM  # noqa: E402

LAYERS = [2, 4, 5]
H, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 100
T = 7  # positions in the draft step


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A config-only Llama target (vLLM reads its sizes; no weights or tokenizer are loaded)."""
    folder = tmp_path_factory.mktemp("target")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}))
    return folder


def vllm_config(target, drafter):
    """The config vLLM builds to serve `target` with `drafter` (eager: no torch.compile)."""
    return EngineArgs(model=str(target), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      compilation_config={"mode": CompilationMode.NONE},
                      speculative_config={"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2},
                      ).create_engine_config()


@pytest.fixture(scope="module")
def one_process_group(target, tmp_path_factory):
    """vLLM's tensor-parallel group of one process (its layers ask for their rank), torn down after."""
    folder = tmp_path_factory.mktemp("group")
    drafter = export(folder / "drafter", "eagle3")
    with set_current_vllm_config(vllm_config(target, drafter)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{folder / 'rendezvous'}")
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def trained_looking_drafter(shape: str) -> Eagle3Drafter:
    """A drafter of `shape` whose norm weights are far from one, so each norm shows where it sits."""
    m = Eagle3Drafter(DrafterConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, intermediate_size=128, target_hidden_size=H,
                                    draft_vocab_size=VOCAB, target_vocab_size=VOCAB, max_position_embeddings=256,
                                    rms_norm_eps=1e-5, **SHAPES[shape]))
    g = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.3 * torch.randn(p.shape, generator=g))
    return m


def export(folder, shape: str, m: Eagle3Drafter | None = None):
    m = m or trained_looking_drafter(shape)
    save_drafter_dir(folder, m.state_dict(), hf_config_from_drafter_config(m.config, LAYERS, dtype="float32"),
                     dtype="float32")
    return folder


def causal_attention(q, k, v, *args, **kwargs):
    """What vLLM's paged attention computes for a prefill of T positions: causal, grouped heads."""
    q = q.view(T, HEADS, HEAD_DIM).transpose(0, 1)  # [T, nh*D] -> [nh, T, D]
    k = k.view(T, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)  # -> [nh, T, D]
    v = v.view(T, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [nh, T, D]
    return out.transpose(0, 1).reshape(T, HEADS * HEAD_DIM)  # -> [T, nh*D]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_vllm_loads_and_runs_the_exported_drafter_as_this_pipeline_trains_it(tmp_path, target, one_process_group,
                                                                             shape):
    m = trained_looking_drafter(shape)
    drafter = export(tmp_path / shape, shape, m)
    config = vllm_config(target, drafter)
    with set_current_vllm_config(config):
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        model.load_weights(load_file(str(drafter / WEIGHTS_NAME)).items())  # vLLM's own loader
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        model.model.layers[0].self_attn.attn.forward = causal_attention
        # vLLM read the shape from config.json and holds the drafter's own norm weights
        assert (model.model.fc_norm is not None) == (shape == "eagle3.1") and model.model.norm_output == (
            shape == "eagle3.1")
        if shape == "eagle3.1":
            for i in range(3):
                assert torch.equal(model.model.fc_norm[i].weight, m.fc_norm[i].weight)
        g = torch.Generator().manual_seed(32)
        aux = torch.randn(T, 3 * H, generator=g) * torch.tensor([0.5, 2.0, 20.0]).repeat_interleave(H)
        embeds = torch.randn(T, H, generator=g)
        with set_forward_context(None, config), torch.no_grad():
            logits_hidden, fed_on = model.model(None, torch.arange(T), model.combine_hidden_states(aux), embeds)
            vllm_logits = model.compute_logits(logits_hidden)
    with torch.no_grad():
        ours = m.step(embeds[None], m.project_aux(aux[None]), TTTCache())[0]  # [T, H]: what feeds the next step
        our_logits = m.compute_logits(ours[None])[0]
    torch.testing.assert_close(fed_on, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(vllm_logits, our_logits, rtol=1e-4, atol=1e-4)
    # vLLM feeds on the state its logits read (post-norm) for eagle3.1 only, the pre-norm one for
    # eagle3: the two differ, so the comparison above tells the shapes apart
    assert torch.allclose(fed_on, logits_hidden) == (shape == "eagle3.1")

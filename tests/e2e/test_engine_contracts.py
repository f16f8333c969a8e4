"""What the stages hand vLLM, checked on CPU against the contracts read in vLLM 0.32's and
torch 2.13's sources (docs/DEVICE_BRANCHES.md names each source).

- Which platform the engine runs on is vLLM's answer (`vllm.platforms.current_platform`),
  never torch's: `eagle3/engines/vllm_engine.py:on_cpu` is the one seam, and every engine setting
  that means something else on CUDA (`gpu_memory_utilization`, `enforce_eager`, the KV
  cache size) follows it. A fake CUDA platform built on vLLM's own `Platform` class stands
  in for the GPU box.
- Asking torch about CUDA before `import vllm` arms torch's fork guard and breaks vLLM's
  forked engine core on a GPU box; the settings must not ask.
- The KV connector reads the hidden-states cache the way vLLM's cache-only layer writes it.
- Each data-parallel rank gets its own full tensor-parallel group of GPUs.

Imports vLLM's CPU build; starts no engine.
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from eagle3.engines import parallel
from eagle3.engines import vllm_engine
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract import vllm_backend
from eagle3.stages.s00_generate import vllm_runner

vllm_platforms = pytest.importorskip("vllm.platforms")
from vllm.platforms.interface import Platform, PlatformEnum  # noqa: E402


class FakeCudaPlatform(Platform):
    """What `current_platform` is on a GPU box with vLLM's CUDA build (its enum and device type)."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H200"


@pytest.fixture
def cuda_vllm(monkeypatch):
    """vLLM resolves its platform to CUDA (torch here still sees no GPU)."""
    monkeypatch.setattr(vllm_platforms, "_current_platform", FakeCudaPlatform())


@pytest.fixture
def torch_never_asked(monkeypatch):
    """Any CUDA probe through torch fails the test: it arms the fork guard (module doc)."""
    def probe(*a, **k):
        raise AssertionError("asked torch about CUDA: before `import vllm` this breaks vLLM's forked engine core")

    for name in ("is_available", "device_count", "init", "is_initialized"):
        monkeypatch.setattr(torch.cuda, name, probe)


INFO = SimpleNamespace(source="some/target", architecture="KimiK25ForConditionalGeneration")


def _extract_kwargs(**kw) -> dict:
    return vllm_backend.engine_kwargs(INFO, tensor_parallel_size=8, dtype="bfloat16", max_model_len=4096,
                                      batch_tokens=8192, gpu_memory_utilization=0.85, kv_cache_gib=None,
                                      enforce_eager=None, trust_remote_code=False, **kw)


def test_this_build_runs_vllms_cpu_platform():
    """The CI machine's vLLM is the CPU build: the CPU settings below are the ones it runs with."""
    assert vllm_platforms.current_platform.is_cpu()
    assert vllm_engine.on_cpu()


def test_engine_settings_on_a_gpu_box_follow_vllms_cuda_platform(cuda_vllm):
    """On CUDA, vLLM sizes the KV cache from `gpu_memory_utilization` x total GPU memory
    (v1/worker/utils.py request_memory) and compiles + captures CUDA graphs unless eager:
    no fixed KV cache size, compiled, and the GPU shares of memory."""
    assert not torch.cuda.is_available() and not vllm_engine.on_cpu()
    gen = vllm_runner.engine_kwargs("some/target", tensor_parallel_size=8)
    assert "kv_cache_memory_bytes" not in gen
    assert gen["enforce_eager"] is False and gen["gpu_memory_utilization"] == pytest.approx(0.9)
    ext = _extract_kwargs()
    assert "kv_cache_memory_bytes" not in ext and ext["enforce_eager"] is False
    assert ext["gpu_memory_utilization"] == pytest.approx(0.85) and ext["tensor_parallel_size"] == 8
    vllm_backend.check_supported(INFO)  # the multimodal Kimi-K2.5 is refused on CPU only


def test_vllm_cpu_on_a_box_where_torch_sees_a_gpu_keeps_the_cpu_settings(monkeypatch):
    """vLLM's platform comes from its build and NVML (vllm/platforms/__init__.py: the `cpu`
    version suffix wins over a visible GPU). Its CPU worker reads `gpu_memory_utilization` as
    the share of RAM (v1/worker/cpu_worker.py): the settings must be the CPU ones even when
    torch, a CUDA build, sees a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gen = vllm_runner.engine_kwargs("some/target")
    assert gen["kv_cache_memory_bytes"] == int(vllm_engine.CPU_KV_CACHE_GIB * (1 << 30))
    assert gen["enforce_eager"] is True and gen["gpu_memory_utilization"] == pytest.approx(0.3)
    assert _extract_kwargs()["enforce_eager"] is True
    with pytest.raises(PipelineError, match="--backend hf on CPU"):
        vllm_backend.check_supported(INFO)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_engine_settings_never_ask_torch_about_cuda(platform, torch_never_asked, monkeypatch):
    """torch.cuda.is_available() (without PYTORCH_NVML_BASED_CUDA_CHECK, which only `import
    vllm` sets) calls `_cuda_getDeviceCount`, which registers torch's fork handler
    (torch/csrc/cuda/Module.cpp `poison_fork`); vLLM forks its engine core by default
    (VLLM_WORKER_MULTIPROC_METHOD=fork, envs.py) and checks only torch.cuda.is_initialized()
    (utils/system_utils.py `_maybe_force_spawn`), which stays False: the core's worker then
    fails with "Cannot re-initialize CUDA in forked subprocess"."""
    if platform == "cuda":
        monkeypatch.setattr(vllm_platforms, "_current_platform", FakeCudaPlatform())
    vllm_runner.engine_kwargs("some/target")
    _extract_kwargs()
    vllm_engine.kv_cache_kwargs(None)
    if platform == "cuda":
        vllm_backend.check_supported(INFO)


def test_every_engine_setting_is_an_engine_argument():
    """What the stages hand `vllm.LLM` on either platform are fields of vLLM's EngineArgs (an
    unknown name is a TypeError at engine start, and CI never starts the GPU settings)."""
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    ext = {**_extract_kwargs(), **vllm_backend.extraction_kwargs([2, 15, 27])}
    gen = vllm_runner.engine_kwargs("some/target", max_model_len=2048)
    cpu_only = vllm_engine.kv_cache_kwargs(0.5)
    for kw in (ext, gen, cpu_only):
        assert set(kw) - {"model"} <= fields, sorted(set(kw) - fields)
    spec = ext["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1  # V1 and V2 require 1
    hf = spec["draft_model_config"]["hf_config"]
    # V2's ExtractHiddenStatesSpeculator (v1/worker/gpu/spec_decode/extract_hidden_states.py) and
    # its layer setup (eagle3_utils.get_eagle3_aux_layers_from_config) read only this top-level key.
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    kv = ext["kv_transfer_config"]
    assert kv.kv_connector_module_path == "eagle3.stages.s02_extract.vllm_connector" and kv.kv_role == "kv_producer"


def test_evaluation_worker_on_a_gpu_box(cuda_vllm, monkeypatch):
    """Stage 06's worker on CUDA: compiled with CUDA graphs (what production serves), 0.85 of
    the GPU, the GPU's name as the platform, and no CPU workaround applied."""
    import eagle3.stages.s06_evaluate.engine as engine

    seen = {}

    def start(req, eager, gmu, per_request):
        seen.update(eager=eager, gmu=gmu)
        return SimpleNamespace(generate=lambda *a, **k: [], get_metrics=lambda: [],
                               llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None)))

    def no_cpu_fix():
        raise AssertionError("the CPU build's sampler workaround must not run on a GPU box")

    monkeypatch.setattr(engine, "_start_engine", start)
    monkeypatch.setattr(engine, "_fix_cpu_sampled_verification", no_cpu_fix)
    req = {"drafter": "some/drafter", "gpu_memory_utilization": None, "enforce_eager": None,
           "num_speculative_tokens": 3, "seed": 0, "max_new_tokens": 4, "prompts": [], "groups": [[]],
           "temperatures": [], "timing_indices": [], "warmup_prompts": 0, "timed_passes": 1}
    out = engine.serve_and_measure(req)
    assert seen == {"eager": False, "gmu": pytest.approx(0.85)}
    assert out["platform"] == "NVIDIA H200" and out["patched_cpu_sampled_verification"] is False


# --------------------------------------------------------------------------- the KV connector's read


def test_connector_reads_the_rows_vllms_cache_only_layer_writes(monkeypatch):
    """vLLM's extraction layer writes token t's [L, H] states at slot s of the cache view
    [num_blocks, L, block_size, H] (`basic_cache`, model_executor/models/extract_hidden_states.py);
    the view may be strided (per-layer views of one buffer, v1/worker/gpu/attn_utils.py). The
    connector's one gather per step must give back each request's rows in token order: layers
    0..L-2 side by side as aux, layer L-1 (id N) as the final state."""
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    from eagle3.stages.s02_extract.vllm_connector import Eagle3StoreConnector, PendingWrite

    L, H, bs, blocks = 4, 8, 16, 12
    # Strided, as a per-layer view of a shared buffer can be: [blocks, bs, L, H] memory seen as [blocks, L, bs, H].
    cache = torch.zeros(blocks, bs, L, H, dtype=torch.bfloat16).transpose(1, 2)
    g = torch.Generator().manual_seed(0)
    reqs = {"a": ([3, 7], 20), "b": ([5], 9), "c": ([1, 10, 2], 40)}  # block ids, prompt tokens
    written = {}
    for rid, (bids, n) in reqs.items():
        slots = (torch.tensor(bids)[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        states = torch.randn(n, L, H, generator=g).bfloat16()
        basic_cache(states, cache, slots)
        written[rid] = states

    conn = object.__new__(Eagle3StoreConnector)  # only the worker-side state the gather reads
    conn._kv_cache, conn._block_size, conn._futures, conn._written = cache, bs, [], set()
    got = {}

    class Pool:
        def submit(self, fn, writes, aux, final):
            got.update(writes=writes, aux=aux, final=final)
            return SimpleNamespace(done=lambda: True, result=lambda: None)

    conn._pool = Pool()
    writes = [PendingWrite(rid, "f", 0, "d", n, bids) for rid, (bids, n) in reqs.items()]
    conn._gather(writes)
    row = 0
    for rid, (_, n) in reqs.items():
        exp = written[rid]
        torch.testing.assert_close(got["aux"][row:row + n], exp[:, :-1].reshape(n, -1), rtol=0, atol=0)
        torch.testing.assert_close(got["final"][row:row + n], exp[:, -1], rtol=0, atol=0)
        row += n
    assert got["aux"].device.type == "cpu" and got["final"].is_contiguous()
    assert conn._written == set(reqs)


# --------------------------------------------------------------------------- GPUs per data-parallel rank


def test_each_rank_gets_a_full_tensor_parallel_group(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b,GPU-c,GPU-d")  # UUIDs, spaces: as CUDA accepts them
    parallel.use_gpu_group(1, tensor_parallel_size=2, data_parallel_size=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d"


def test_too_few_visible_gpus_are_refused_before_any_engine_starts(monkeypatch):
    """CUDA reads CUDA_VISIBLE_DEVICES once per process; a rank left with fewer GPUs than its
    tensor parallel size (here rank 1 with none) would fail only when its engine starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    for rank in (0, 1):
        with pytest.raises(PipelineError, match=r"CUDA_VISIBLE_DEVICES=0,1,2 lists 3 GPU\(s\), but "
                                                r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4"):
            parallel.use_gpu_group(rank, tensor_parallel_size=2, data_parallel_size=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"

"""What the stages hand vLLM, checked on CPU against the contracts read in vLLM 0.32's and
torch 2.13's sources (docs/DEVICE_BRANCHES.md names each source).

- Stages 00, 02 and 06 build one `EngineConfig` each (eagle3/engines/config.py) and start
  it through `eagle3/engines/vllm_engine.py:start_llm`; `engine_kwargs` is the one path
  from it to `vllm.LLM(**kwargs)`, checked here per stage and per platform against vLLM's
  `EngineArgs` (and stage 02's and 06's speculative settings against `SpeculativeConfig`).
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
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eagle3.stages.s06_evaluate.engine as evaluate_engine
from eagle3.core.errors import PipelineError
from eagle3.engines import parallel, vllm_engine
from eagle3.engines.config import CPU_KV_CACHE_GIB, CPU_MEMORY_SHARE, GPU_MEMORY_SHARE, EngineConfig
from eagle3.stages.s00_generate import vllm_runner
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s02_extract import vllm_backend
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s06_evaluate.config import EvaluateConfig

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
AUX = [2, 15, 27]


# Each stage's engine as its run builds it: the stage config's `engine_config`, then what the
# stage's engine module adds (stage 02: exact extraction + connector; stage 06: the drafter).
def generate_engine(**kw) -> EngineConfig:
    cfg = GenerateConfig(work_dir=Path("w"), target_model="some/target", data=["chats.jsonl"], **kw)
    return vllm_runner.generation_engine(cfg.engine_config())


def extract_engine(**kw) -> EngineConfig:
    cfg = ExtractConfig(work_dir=Path("w"), **{"target_model": "some/target", "tensor_parallel_size": 8, **kw})
    engine = cfg.engine_config(model=INFO.source, max_model_len=4096)
    return vllm_backend.extracting(vllm_backend.extraction_engine(engine, batch_tokens=8192), AUX)


def evaluate_engine_for(drafter: str | None = "some/drafter", **kw) -> EngineConfig:
    cfg = EvaluateConfig(work_dir=Path("w"), **{"target_model": "some/target", **kw})
    part = {"name": "trained" if drafter else "plain", "drafter": drafter, "temperatures": []}
    req = {**evaluate_engine.engine_request(cfg.engine_config(max_model_len=512)), "engines": [part],
           "num_speculative_tokens": cfg.num_speculative_tokens}
    return evaluate_engine.run_engine_config(req, part, on_cpu=vllm_engine.on_cpu())


STAGE_ENGINES = {"generate": generate_engine, "extract": extract_engine, "evaluate": evaluate_engine_for}


def test_this_build_runs_vllms_cpu_platform():
    """The CI machine's vLLM is the CPU build: the CPU settings below are the ones it runs with."""
    assert vllm_platforms.current_platform.is_cpu()
    assert vllm_engine.on_cpu()


@pytest.mark.parametrize("stage", STAGE_ENGINES)
def test_engine_settings_on_a_gpu_box_follow_vllms_cuda_platform(stage, cuda_vllm):
    """On CUDA, vLLM sizes the KV cache from `gpu_memory_utilization` x total GPU memory
    (v1/worker/utils.py request_memory) and compiles + captures CUDA graphs unless eager:
    no fixed KV cache size, compiled, and the GPU share of memory, the same for every stage."""
    assert not torch.cuda.is_available() and not vllm_engine.on_cpu()
    kw = vllm_engine.engine_kwargs(STAGE_ENGINES[stage]())
    assert "kv_cache_memory_bytes" not in kw and kw["enforce_eager"] is False
    assert kw["gpu_memory_utilization"] == pytest.approx(GPU_MEMORY_SHARE)
    if stage == "extract":
        assert kw["tensor_parallel_size"] == 8
    # What a user sets wins on either platform.
    kw = vllm_engine.engine_kwargs(STAGE_ENGINES[stage](gpu_memory_utilization=0.5, kv_cache_gib=2.0,
                                                        enforce_eager=True))
    assert kw["gpu_memory_utilization"] == 0.5 and kw["kv_cache_memory_bytes"] == 2 << 30 and kw["enforce_eager"]


@pytest.mark.parametrize("stage", STAGE_ENGINES)
def test_vllm_cpu_on_a_box_where_torch_sees_a_gpu_keeps_the_cpu_settings(stage, monkeypatch):
    """vLLM's platform comes from its build and NVML (vllm/platforms/__init__.py: the `cpu`
    version suffix wins over a visible GPU). Its CPU worker reads `gpu_memory_utilization` as
    the share of RAM (v1/worker/cpu_worker.py): the settings must be the CPU ones even when
    torch, a CUDA build, sees a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = vllm_engine.engine_kwargs(STAGE_ENGINES[stage]())
    assert kw["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * (1 << 30))
    assert kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == pytest.approx(CPU_MEMORY_SHARE)


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
    for build in STAGE_ENGINES.values():
        vllm_engine.engine_kwargs(build())


def _engine_args_fields() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def test_every_engine_config_field_is_an_engine_argument():
    """`engine_kwargs` hands vLLM each EngineConfig field under its own name (but the three
    it translates or spends itself): each must be an EngineArgs field, or `vllm.LLM` raises
    a TypeError at engine start."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - set(vllm_engine.NOT_LLM_ARGS)
    assert names <= _engine_args_fields(), sorted(names - _engine_args_fields())
    assert "kv_cache_memory_bytes" in _engine_args_fields()


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("stage", STAGE_ENGINES)
def test_every_engine_setting_is_an_engine_argument(stage, platform, monkeypatch):
    """What each stage hands `vllm.LLM` on either platform are fields of vLLM's EngineArgs (an
    unknown name is a TypeError at engine start, and CI never starts the GPU settings), and its
    speculative settings are fields of vLLM's SpeculativeConfig."""
    from vllm.config import SpeculativeConfig

    if platform == "cuda":
        monkeypatch.setattr(vllm_platforms, "_current_platform", FakeCudaPlatform())
    kw = vllm_engine.engine_kwargs(STAGE_ENGINES[stage](kv_cache_gib=0.5))
    assert set(kw) <= _engine_args_fields(), sorted(set(kw) - _engine_args_fields())
    assert kw["model"] == "some/target" and kw["kv_cache_memory_bytes"] == 1 << 29
    spec = kw.get("speculative_config")
    if spec is not None:
        spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        assert set(spec) <= spec_fields, sorted(set(spec) - spec_fields)


@pytest.mark.parametrize("stage", STAGE_ENGINES)
def test_a_multimodal_target_is_served_as_its_text_model(stage, tiny_targets, monkeypatch):
    """Kimi-K2.5 (its text model under `text_config`) starts with `language_model_only`: vLLM
    0.32 then builds its vision tower as meta-device placeholders (no weights loaded;
    model_executor/models/interfaces.py `_mark_tower_model`, skipped when every modality's
    limit is 0, which `MultiModalConfig.get_limit_per_prompt` returns under that flag) and
    profiles no dummy image (config/model.py: no multimodal inputs when every limit is 0).
    A text target keeps vLLM's default."""
    for kind, want in (("kimi_k25", True), ("llama", False), ("deepseek_v3", False)):
        target = str(tiny_targets[kind])
        monkeypatch.setattr(INFO, "source", target)
        build = {"generate": lambda: vllm_runner.generation_engine(GenerateConfig(
                     work_dir=Path("w"), target_model=target, data=["c.jsonl"]).engine_config()),
                 "extract": lambda: extract_engine(target_model=target),
                 "evaluate": lambda: evaluate_engine_for(target_model=target)}[stage]
        kw = vllm_engine.engine_kwargs(build())
        assert kw["model"] == target and kw["language_model_only"] is want, (stage, kind)
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs(model=target, language_model_only=True).language_model_only  # the argument's name in 0.32


def test_extraction_engine_settings():
    """Stage 02's engine keeps stored states exact (vllm_backend's module doc) and asks for the
    aux layers through the extraction method and our connector."""
    kw = vllm_engine.engine_kwargs(extract_engine())
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_num_batched_tokens"] == 8192 and kw["max_model_len"] == 4096 and kw["seed"] == 0
    spec = kw["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1  # V1 and V2 require 1
    hf = spec["draft_model_config"]["hf_config"]
    # V2's ExtractHiddenStatesSpeculator (v1/worker/gpu/spec_decode/extract_hidden_states.py) and
    # its layer setup (eagle3_utils.get_eagle3_aux_layers_from_config) read only this top-level key.
    assert hf["eagle_aux_hidden_state_layer_ids"] == AUX
    kv = kw["kv_transfer_config"]
    assert kv.kv_connector_module_path == "eagle3.stages.s02_extract.vllm_connector" and kv.kv_role == "kv_producer"
    # The batch holds at least one whole sample, whatever --batch-tokens says.
    assert vllm_engine.engine_kwargs(vllm_backend.extraction_engine(
        EngineConfig(model="t", max_model_len=4096), batch_tokens=100))["max_num_batched_tokens"] == 4096


def test_generation_and_evaluation_engine_settings():
    """Stage 00 keeps prefix caching on (a multi-turn round reuses earlier turns) and its seed;
    stage 06 turns it off (timed prefills cost what a new prompt's does), keeps log stats on
    (its spec-decode counters), serves the drafter with EAGLE-3 and asks per-request metrics
    only of an engine that has them."""
    gen = vllm_engine.engine_kwargs(generate_engine(seed=7, max_num_seqs=32, max_model_len=2048))
    assert gen["enable_prefix_caching"] is True and gen["disable_log_stats"] is True
    assert (gen["seed"], gen["max_num_seqs"], gen["max_model_len"]) == (7, 32, 2048)
    ev = vllm_engine.engine_kwargs(evaluate_engine_for(seed=3, max_num_seqs=16, num_speculative_tokens=5))
    assert ev["enable_prefix_caching"] is False and ev["disable_log_stats"] is False
    assert (ev["seed"], ev["max_num_seqs"], ev["max_model_len"]) == (3, 16, 512)
    assert ev["speculative_config"] == {"method": "eagle3", "model": "some/drafter", "num_speculative_tokens": 5}
    assert ev["per_request_spec_decode_metrics"] == "summary"
    plain = vllm_engine.engine_kwargs(evaluate_engine_for(drafter=None))
    assert "speculative_config" not in plain and "per_request_spec_decode_metrics" not in plain


def test_start_llm_hands_vllm_the_engine_kwargs(monkeypatch):
    """`start_llm` builds `vllm.LLM(**engine_kwargs(engine))`, sets the in-process switch for
    that start only, and names the model and the fix when vLLM refuses."""
    import vllm

    seen = []

    def fake_llm(**kw):
        seen.append((kw, os.environ.get(vllm_engine.IN_PROCESS_ENV)))
        if kw["model"] == "bad":
            raise ValueError("no such model")
        return "engine"

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.delenv(vllm_engine.IN_PROCESS_ENV, raising=False)
    engine = generate_engine(engine_in_process=True)
    assert vllm_engine.start_llm(engine, fix="check it") == "engine"
    assert seen == [(vllm_engine.engine_kwargs(engine), "0")]
    assert vllm_engine.IN_PROCESS_ENV not in os.environ
    with pytest.raises(PipelineError, match=r"vLLM could not start bad \(ValueError: no such model\); check it\."):
        vllm_engine.start_llm(EngineConfig(model="bad"), fix="check it")
    assert seen[-1][1] is None  # spawned: the switch untouched


def test_engine_config_refuses_what_it_cannot_hand_vllm():
    with pytest.raises(PipelineError, match=r"extra sets \['dtype', 'kv_cache_memory_bytes'\]"):
        EngineConfig(model="t", extra={"dtype": "float16", "kv_cache_memory_bytes": 1})
    with pytest.raises(PipelineError, match=r"gpu_memory_utilization = 1.5 must be in \(0, 1\]"):
        EngineConfig(model="t", gpu_memory_utilization=1.5)
    with pytest.raises(PipelineError, match=r"kv_cache_gib = 0 must be > 0"):
        EngineConfig(model="t", kv_cache_gib=0)


def test_evaluation_worker_on_a_gpu_box(cuda_vllm, monkeypatch):
    """Stage 06's worker on CUDA: compiled with CUDA graphs (what production serves), the GPU
    share of memory, the GPU's name as the platform, and no CPU workaround applied."""
    seen = []

    def start(engine):
        seen.append(engine)
        return SimpleNamespace(generate=lambda *a, **k: [], get_metrics=lambda: [],
                               llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None)))

    def no_cpu_fix():
        raise AssertionError("the CPU build's sampler workaround must not run on a GPU box")

    monkeypatch.setattr(evaluate_engine, "_start_engine", start)
    monkeypatch.setattr(evaluate_engine, "_fix_cpu_sampled_verification", no_cpu_fix)
    cfg = EvaluateConfig(work_dir=Path("w"), target_model="some/target")
    trained = {"name": "trained", "drafter": "some/drafter", "temperatures": []}
    req = {**evaluate_engine.engine_request(cfg.engine_config(max_model_len=64)), "engines": [trained],
           "num_speculative_tokens": 3, "max_new_tokens": 4, "prompts": [],
           "timing_blocks": [], "warmup_prompts": 0}
    out = evaluate_engine.serve_and_measure(req)
    (engine,) = seen
    assert engine.enforce_eager is False and engine.gpu_memory_utilization == pytest.approx(GPU_MEMORY_SHARE)
    assert engine.kv_cache_gib is None and engine.speculative_config["model"] == "some/drafter"
    assert out["enforce_eager"] is False and out["gpu_memory_utilization"] == pytest.approx(GPU_MEMORY_SHARE)
    assert out["platform"] == "NVIDIA H200" and out["patched_cpu_sampled_verification"] is False
    # The timed run's two engines live side by side: vLLM would refuse the second one a share
    # larger than what the first left free, so they split the share, the default or the user's.
    plain = {"name": "plain", "drafter": None, "temperatures": []}
    seen.clear()
    evaluate_engine.serve_and_measure({**req, "engines": [plain, trained]})
    assert [e.gpu_memory_utilization for e in seen] == pytest.approx([GPU_MEMORY_SHARE / 2] * 2)
    assert [e.speculative_config is None for e in seen] == [True, False]  # plain first
    chosen = {**evaluate_engine.engine_request(EvaluateConfig(work_dir=Path("w"), target_model="some/target",
                                                              gpu_memory_utilization=0.4).engine_config()),
              **{k: v for k, v in req.items() if k not in evaluate_engine.ENGINE_KEYS}}
    seen.clear()
    evaluate_engine.serve_and_measure({**chosen, "engines": [plain, trained]})
    assert [e.gpu_memory_utilization for e in seen] == pytest.approx([0.2, 0.2])


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


def test_llvmlite_guard_lets_vllms_cpu_kernel_scan_pass_the_kimi_module():
    """vLLM 0.32's CPU worker scans every module namespace for Triton kernels to override
    (triton_utils/dispatcher.py `_rebind_kernels`, `vars(value).get("kernel")`); the Kimi class's
    module loads numba and so llvmlite, whose `ffi.lib` proxy answers `__dict__` with a function
    wrapper. Guarded, the scan passes and llvmlite's library still answers (docs/KIMI_K25.md)."""
    import vllm.model_executor.models.kimi_k25  # noqa: F401 - imports numba, and so llvmlite
    from llvmlite import binding
    from vllm.triton_utils import dispatcher

    assert vllm_engine.guard_llvmlite_proxy() and vllm_engine.guard_llvmlite_proxy()  # idempotent
    dispatcher._rebind_kernels([])
    assert not hasattr(binding.ffi.lib, "__dict__")
    assert binding.get_host_cpu_name()

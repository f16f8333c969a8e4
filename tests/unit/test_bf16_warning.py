"""eagle3/engines/vllm_engine.py `warn_if_bf16_is_emulated`: an AVX2-only CPU runs vLLM's
bf16 emulated (the demo's stage 00 ~10x slower); the stage says so once, and only then."""
import logging

from eagle3.engines.vllm_engine import warn_if_bf16_is_emulated


def test_bf16_on_a_cpu_without_bf16_matmuls_is_named(caplog):
    with caplog.at_level(logging.WARNING, logger="eagle3.engines.vllm_engine"):
        assert warn_if_bf16_is_emulated("bfloat16", has_bf16=lambda: False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no bf16 matmuls in hardware" in line and "--dtype float32" in line


def test_no_warning_where_bf16_is_native_or_not_asked_for(caplog):
    with caplog.at_level(logging.WARNING, logger="eagle3.engines.vllm_engine"):
        assert not warn_if_bf16_is_emulated("bfloat16", has_bf16=lambda: True)
        assert not warn_if_bf16_is_emulated("float32", has_bf16=lambda: False)
        assert not warn_if_bf16_is_emulated("float16", has_bf16=lambda: False)
    assert caplog.records == []

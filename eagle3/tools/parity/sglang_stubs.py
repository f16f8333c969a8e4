"""The two import stubs SGLang 0.5.23 needs to import its model classes on a CPU-only machine.

Installed by eagle3/tools/parity/sglang_side.py before `import sglang`, in the SGLang
environment only (`.venv-sglang`, made by scripts/setup_cpu.sh); docs/DEVICE_BRANCHES.md
lists them with why. Nothing a stub stands in for runs in the parity check:

- `torchvision`: SGLang's config package imports its vision processors at import time
  (srt/configs/__init__.py -> nano_nemotron_vl.py -> multimodal/internvl_utils.py:
  `import torchvision.transforms`), and PyPI's torchvision wheels are CUDA builds that do not
  match the CPU torch (docs/CONVENTIONS.md; scripts/setup_cpu.sh removes them for vLLM too).
  Transformers asks whether torchvision is installed and caches the answer; it is asked
  first, so transformers keeps knowing it is absent.
- `sgl_kernel`: SGLang's compiled kernels (the registry's `sglang-kernel` wheel is a
  536 MB CUDA build, `libnvrtc.so.12` missing here) are imported at module level by its
  kv-cache and quantization modules. `sgl_kernel.scalar_type` is left missing on purpose:
  SGLang's quantization utilities fall back to their own scalar types when it cannot be
  imported (srt/layers/quantization/utils.py `get_scalar_types`), and its layers then take
  their `forward_native` paths on the CPU.

Triton needs no stub: the global environment's `triton` (a vLLM dependency) imports.
A stub module answers every attribute with a child stub (or, for a capitalised name, a
class whose attributes are names), is callable as a pass-through decorator, and raises
nothing at import; any real use of one in the parity check's path would show as a wrong
result, never a silent one, because every result is compared with the reference drafter.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision", "sgl_kernel")
LEFT_MISSING = ("sgl_kernel.scalar_type",)


class _AnyName(type):
    """A stub class: every attribute is its dotted name (enough for enum-like module constants)."""

    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in LEFT_MISSING:
            raise AttributeError(name)
        if name[:1].isupper():
            return _AnyName(name, (), {})
        return importlib.import_module(full)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @stub
        return lambda fn: fn  # @stub(...)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname in LEFT_MISSING:
            raise ModuleNotFoundError(f"No module named {fullname!r} (left missing on purpose)", name=fullname)
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> tuple[str, ...]:
    """Put the stubs for the packages that are absent in front of the import system (once) and
    return their names; transformers is asked first whether torchvision is installed (it caches
    the answer), so it goes on knowing the truth."""
    import importlib.util

    from transformers.utils import import_utils

    found = [f for f in sys.meta_path if isinstance(f, _StubFinder)]
    if found:
        return found[0].roots
    import_utils.is_torchvision_available()
    roots = tuple(r for r in STUBBED if importlib.util.find_spec(r) is None)
    sys.meta_path.insert(0, _StubFinder(roots))
    return roots

"""docs/DEVICE_BRANCHES.md lists every device, backend and engine-platform branch of eagle3/.

A branch is code that behaves differently per device, per collective backend or per vLLM
platform; the rule (docs/DEVICE_BRANCHES.md, top) is that each one is read against the
real source, sits behind a seam CPU CI exercises, and has a row naming its cover. This
test finds them by syntax (no imports, no strings or comments counted except backend
names), so a new branch fails CI until its row exists:

    x.device.type / device.type / torch.device(...).type     torch.cuda.*
    torch.cpu._is_* / torch.backends.cpu.*                   current_platform
    the seams' calls: on_cpu(), bf16_fused_attention_ok(), bf16_pays()
    == "cuda" / == "cpu"                                     "nccl", "gloo", "cpu:gloo,cuda:nccl"
    "CUDA_VISIBLE_DEVICES", "VLLM_CPU_*"

and every `eagle3/...py:name` the document names must still exist (no stale rows).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "DEVICE_BRANCHES.md"
SEAM_CALLS = {"on_cpu", "bf16_fused_attention_ok", "bf16_pays"}
BACKEND_NAME = re.compile(r"^(?:[a-z]+:)?(?:nccl|gloo)(?:,(?:[a-z]+:)?(?:nccl|gloo))*$")
DEVICE_WORDS = {"cuda", "cpu"}
NAMED = re.compile(r"eagle3/[\w/]+\.py:[\w.<>]+")


def _chain(node: ast.AST) -> str:
    """`torch.cuda.is_available` for an attribute chain (calls and subscripts cut it)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _why(node: ast.AST) -> str | None:
    """What makes `node` a device branch, or None."""
    if isinstance(node, ast.Attribute):
        if node.attr == "type":
            v = node.value
            if ((isinstance(v, ast.Attribute) and v.attr == "device")
                    or (isinstance(v, ast.Name) and v.id in ("device", "dev"))
                    or (isinstance(v, ast.Call) and _chain(v.func).endswith("device"))):
                return "device.type"
        chain = _chain(node)
        if chain.startswith(("torch.cuda.", "torch.cpu._is_", "torch.backends.cpu.")):
            return chain
        if node.attr == "current_platform":
            return "current_platform"
    if isinstance(node, ast.Name) and node.id == "current_platform":
        return "current_platform"
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in SEAM_CALLS:
            return f"{name}()"
    if isinstance(node, ast.Compare):
        for c in [node.left, *node.comparators]:
            if isinstance(c, ast.Constant) and c.value in DEVICE_WORDS:
                return f"== {c.value!r}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        s = node.value
        if BACKEND_NAME.match(s) or s == "CUDA_VISIBLE_DEVICES" or s.startswith("VLLM_CPU_"):
            return repr(s)
    return None


def _defs(tree: ast.Module):
    """(qualified name, node) of every function and class, outermost first."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def device_branches(root: Path = ROOT) -> dict[str, set[str]]:
    """`eagle3/<file>.py:<qualified function>` (or `:<module>`) -> what was found there."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / "eagle3").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        spans = [(n.lineno, n.end_lineno, name) for name, n in _defs(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        classes = [(n.lineno, n.end_lineno, name) for name, n in _defs(tree) if isinstance(n, ast.ClassDef)]
        for node in ast.walk(tree):
            why = _why(node)
            if why is None:
                continue
            line = node.lineno
            inner = [s for s in spans if s[0] <= line <= s[1]] or [s for s in classes if s[0] <= line <= s[1]]
            name = max(inner, key=lambda s: s[0])[2] if inner else "<module>"
            found.setdefault(f"{rel}:{name}", set()).add(why)
    return found


def test_every_device_branch_has_a_row():
    doc = DOC.read_text()
    missing = {k: v for k, v in device_branches().items() if f"`{k}`" not in doc}
    assert not missing, (
        "device/backend/platform branches with no row in docs/DEVICE_BRANCHES.md (add one: what each device "
        "does, the contract read in the real source, the CPU test that covers it, what only the GPU check "
        "covers):\n" + "\n".join(f"  {k}  ({', '.join(sorted(v))})" for k, v in sorted(missing.items())))


def test_every_named_function_exists():
    stale = []
    for ref in sorted(set(NAMED.findall(DOC.read_text()))):
        rel, name = ref.split(":", 1)
        path = ROOT / rel
        if not path.is_file():
            stale.append(f"{ref} (no such file)")
        elif name != "<module>" and name not in {n for n, _ in _defs(ast.parse(path.read_text()))}:
            stale.append(f"{ref} (no such function or class)")
    assert not stale, "docs/DEVICE_BRANCHES.md names code that is gone; update its rows:\n  " + "\n  ".join(stale)


def test_the_finder_sees_each_kind_of_branch(tmp_path):
    """The syntax the inventory keys on, on a made-up module: each kind found, strings and comments not."""
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "m.py").write_text('''"""Docs may say cuda, nccl, device.type, torch.cuda.init() freely."""
import torch

def a(x):
    return 1 if x.device.type == "cuda" else 2  # torch.cuda in a comment

class K:
    def b(self):
        return torch.cuda.get_rng_state_all()

def c():
    from vllm.platforms import current_platform
    return current_platform.is_cpu()

def d(group):
    return "cpu:gloo,cuda:nccl", torch.device("cuda", 0).type

def e(choice):
    return choice == "cpu" and bf16_fused_attention_ok()

def f():
    return "no device here", "the cuda word in a message"
''')
    found = device_branches(tmp_path)
    assert set(found) == {"eagle3/m.py:a", "eagle3/m.py:K.b", "eagle3/m.py:c", "eagle3/m.py:d", "eagle3/m.py:e"}
    assert found["eagle3/m.py:a"] == {"device.type", "== 'cuda'"}
    assert found["eagle3/m.py:K.b"] == {"torch.cuda.get_rng_state_all"}
    assert found["eagle3/m.py:d"] == {"'cpu:gloo,cuda:nccl'", "device.type"}

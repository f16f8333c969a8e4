"""The package's layout rules, read from the code's own imports (eagle3/core/stages.py says why).

    core/     imports only core
    engines/  imports core and engines
    stages/   a stage imports core, engines and its own package: never another stage
    tools/    may import anything; nothing else imports a tool

and no module imports one of ours inside a function, so every link between modules shows at
the top of the file. The stage folders, the registry and the numbered scripts agree.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eagle3.core.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported eagle3 module, line, inside a function) for every import of ours in `path`."""
    tree = ast.parse(path.read_text())
    in_function = {id(sub) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write the module's whole name")
        names = ([node.module] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name and (name == "eagle3" or name.startswith("eagle3.")):
                found.append((name, node.lineno, id(node) in in_function))
    return found


def layer(module: str) -> tuple[str, str]:
    """("stages", "eagle3.stages.s04_train") for a stage's module; ("core", "") and so on otherwise."""
    parts = module.split(".")
    kind = parts[1] if len(parts) > 1 else ""
    return kind, ".".join(parts[:3]) if kind == "stages" and len(parts) > 2 else ""


def allowed(importer: str, imported: str) -> bool:
    kind, stage = layer(importer)
    to_kind, to_stage = layer(imported)
    if kind == "tools":
        return True
    if to_kind == "tools":
        return False
    if kind == "core":
        return to_kind == "core"
    if kind == "engines":
        return to_kind in ("core", "engines")
    if kind == "stages":
        return to_kind in ("core", "engines") or (to_kind == "stages" and to_stage == stage)
    return True  # eagle3/__init__.py


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_import_follows_the_layers():
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {imp}"
             for p in MODULES for imp, line, _ in our_imports(p) if not allowed(module_name(p), imp)]
    assert not wrong, "imports across the layers (see this file's docstring):\n" + "\n".join(wrong)


def test_no_import_of_ours_hides_inside_a_function():
    hidden = [f"{p.relative_to(ROOT)}:{line} imports {imp}"
              for p in MODULES for imp, line, inside in our_imports(p) if inside]
    assert not hidden, "move these imports to the top of their module:\n" + "\n".join(hidden)


def test_the_checker_sees_a_sideways_import(tmp_path):
    # The rules above pass vacuously if the parser missed imports: feed it known cases.
    assert not allowed("eagle3.stages.s05_export.run", "eagle3.stages.s02_extract.run")
    assert not allowed("eagle3.drafter.model", "eagle3.stages.s03_vocab.run")
    assert not allowed("eagle3.engines.vllm_engine", "eagle3.stages.s06_evaluate.engine")
    assert not allowed("eagle3.stages.s04_train.run", "eagle3.tools.demo")
    assert allowed("eagle3.stages.s04_train.run", "eagle3.stages.s04_train.data")
    assert allowed("eagle3.tools.forecast", "eagle3.stages.s04_train.run")
    f = tmp_path / "m.py"
    f.write_text("from eagle3.core import store\n\ndef f():\n    from eagle3.drafter.model import DrafterConfig\n")
    assert our_imports(f) == [("eagle3.core", 1, False), ("eagle3.drafter.model", 4, True)]


def test_the_stage_folders_are_the_registry_in_order():
    folders = sorted(p.name for p in (PACKAGE / "stages").iterdir() if (p / "__init__.py").is_file())
    assert folders == [s.package.rsplit(".", 1)[1] for s in STAGES]
    for i, s in enumerate(STAGES):
        assert s.package.endswith(f".s{i:02d}_{s.package.rsplit('_', 1)[1]}") and s.number == f"{i:02d}"
        assert s.folder.startswith(s.number) and s.script.startswith(s.number)


@pytest.mark.parametrize("stage", STAGES, ids=[s.key for s in STAGES])
def test_each_stage_has_its_config_its_entry_and_its_script(stage):
    cfg = stage.config_type()
    assert cfg.__module__ == f"{stage.package}.config"
    assert callable(stage.entry_function())
    script = (ROOT / stage.script).read_text()
    assert re.search(rf'stage_main\("{stage.key}"', script), f"{stage.script} does not start stage {stage.key!r}"

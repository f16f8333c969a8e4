"""The package's layout rules, read from the code's own imports (eagle3/core/stages.py says why).

The packages by concept, each importing only those named after it (and itself):

    core/       config, the CLI, the stage registry, logs, errors, readable figures, batching:
                core only (each package's __init__.py says what it owns)
    artifacts/  what the stages hand on, on disk: core
    target/     the target's files, the chat rendering and its loss mask: core
    drafter/    the model, the TTT loss, the attention kernels, CPU precision, the shape: core,
                artifacts (the draft vocabulary's arithmetic), target (TargetInfo, for the shape)
    serving/    what the engines' loaders require, the drafter folder, the model card: core,
                artifacts, target, drafter
    core/cli.py the numbered scripts' command line: core and artifacts (it opens the stage's run
                record and its log file), a layer of its own above the artifacts
    engines/    vLLM: core, artifacts, target, drafter, serving, engines
    stages/     a stage: what engines may import, engines, and its own package; never another stage
                (stages/configs.py, every stage's config class by YAML section, imports each
                stage's config.py and nothing else of theirs; no stage imports it)
    demo/       the demo's targets, chats and summary, the tests' and benchmarks' inputs: everything
                above but the tools and core/cli.py; nothing else of ours imports it
    tools/      the operator's commands: anything but the demo; nothing else imports a tool

so the packages form no cycle (the rules themselves are checked for one), and no module imports
one of ours inside a function, so every link between modules shows at the top of the file. Nor do
the modules themselves import each other in a circle, inside a package either: a reader following
a call never comes back to the module it started from. The stage folders, the registry and the
numbered scripts agree, and each script imports its stage's config and entry function by name.
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from eagle3.core.stages import STAGES
from eagle3.stages.configs import STAGE_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3"

CONCEPTS = ("core", "artifacts", "target", "drafter", "serving")
LOWER = set(CONCEPTS)
# Layer -> the layers it may import. A stage's own package is added in `allowed`.
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "artifacts": {"core", "artifacts"},
    "target": {"core", "target"},
    "drafter": {"core", "artifacts", "target", "drafter"},
    "serving": {"core", "artifacts", "target", "drafter", "serving"},
    "core.cli": {"core", "artifacts", "core.cli"},
    "engines": LOWER | {"engines"},
    "stages": LOWER | {"engines"},
    "demo": LOWER | {"engines", "stages", "demo"},
    "tools": LOWER | {"core.cli", "engines", "stages", "tools"},
}
# What core/ keeps: plumbing every layer may use, no artifact, model or engine in it.
CORE_MODULES = {"__init__", "batching", "cli", "config", "errors", "logs", "readable", "stages"}
# eagle3/tools/ and eagle3/demo/ split by audience: an operator's commands for runs on real
# targets, and what the demo, the tests and the benchmarks build (each __init__.py says more).
TOOLS = {"__init__", "check_stores", "diagnose", "forecast", "parity", "window_loop"}
DEMO = {"__init__", "kimi_k25_tokenizer", "summary", "synthetic_chats", "targets", "tiny"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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
    """("stages", "eagle3.stages.s04_train") for a stage's module; ("core.cli", ""), ("drafter", "")
    and so on otherwise; ("", "") for eagle3 itself."""
    parts = module.split(".")
    kind = parts[1] if len(parts) > 1 else ""
    if module == "eagle3.core.cli":
        kind = "core.cli"
    return kind, ".".join(parts[:3]) if kind == "stages" and len(parts) > 2 else ""


# The map of section -> config class (what a YAML file is checked against) and what it may import.
STAGE_CONFIGS_MODULE = "eagle3.stages.configs"
STAGE_CONFIG = re.compile(r"eagle3\.stages\.s\d\d_\w+\.config")


def allowed(importer: str, imported: str) -> bool:
    kind, stage = layer(importer)
    to_kind, to_stage = layer(imported)
    if kind not in ALLOWED:
        return kind == ""  # eagle3/__init__.py; a package not in ALLOWED breaks every rule
    if importer == STAGE_CONFIGS_MODULE and to_kind == "stages":
        return bool(STAGE_CONFIG.fullmatch(imported))
    if kind == "stages" and to_kind == "stages":
        return to_stage == stage
    return to_kind in ALLOWED[kind]


def violations(root: Path = ROOT) -> list[str]:
    """Every import of ours under root/eagle3 that the layers forbid, as 'file:line imports module'."""
    return [f"{p.relative_to(root)}:{line} imports {imp}"
            for p in sorted((root / "eagle3").rglob("*.py")) for imp, line, _ in our_imports(p)
            if not allowed(module_name(p, root), imp)]


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (node -> nodes it points at; self-loops ignored), or []."""
    state: dict[str, int] = {}  # 1 on the path being walked, 2 done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ()) - {node}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return []


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module under root/eagle3 -> the modules of ours it imports, at the top or inside a
    function. `from eagle3.x import y` imports eagle3.x.y when y is a module, else eagle3.x.
    Not seen: relative imports (test_every_import_follows_the_layers refuses them) and modules
    named by a string at run time (`importlib.import_module(f"...")`, the stage registry's)."""
    modules = {module_name(p, root): p for p in (root / "eagle3").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                imported |= submodules or {node.module}
                if len(submodules) < len(node.names):  # names defined in the package itself too
                    imported.add(node.module)
    return graph


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_import_follows_the_layers():
    wrong = violations()
    assert not wrong, "imports across the layers (see this file's docstring):\n" + "\n".join(wrong)


def test_the_layers_form_no_cycle():
    assert not cycle(ALLOWED), f"the rules allow a cycle: {' -> '.join(cycle(ALLOWED))}"


def test_no_import_of_ours_hides_inside_a_function():
    hidden = [f"{p.relative_to(ROOT)}:{line} imports {imp}"
              for p in MODULES for imp, line, inside in our_imports(p) if inside]
    assert not hidden, "move these imports to the top of their module:\n" + "\n".join(hidden)


def test_no_modules_import_each_other_in_a_circle():
    # Within a package too (the layers above allow any import inside one): two modules that
    # need each other share steps that belong in a third module both import.
    circle = cycle(module_graph())
    assert not circle, ("these modules import each other in a circle; move what they share into a module "
                        "of its own:\n" + " -> ".join(circle))


def test_the_packages_are_the_concepts():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == {k for k in ALLOWED if "." not in k}, "a package without import rules (ALLOWED)"
    for name in CONCEPTS:
        init = PACKAGE / name / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} says nothing of what it owns"
    kept = {p.stem for p in (PACKAGE / "core").glob("*.py")} | {p.name for p in (PACKAGE / "core").iterdir()
                                                                if (p / "__init__.py").is_file()}
    assert kept == CORE_MODULES, f"eagle3/core/ holds {sorted(kept - CORE_MODULES)}: give each its concept's package"


def package_contents(package: Path) -> set[str]:
    """The modules (by stem) and subpackages of a package."""
    return ({path.stem for path in package.glob("*.py")}
            | {path.name for path in package.iterdir() if (path / "__init__.py").is_file()})


def test_operator_tools_and_the_demo_are_split_by_audience():
    assert package_contents(PACKAGE / "tools") == TOOLS, "eagle3/tools/ is the operator's commands; the demo's " \
                                                        "targets, chats and summary go in eagle3/demo/"
    assert package_contents(PACKAGE / "demo") == DEMO, "eagle3/demo/ is what the demo and the tests build"
    # the import rules: the tools never import the demo, and the library imports neither
    assert "demo" not in ALLOWED["tools"]
    assert [k for k, v in ALLOWED.items() if "tools" in v and k != "tools"] == []
    assert [k for k, v in ALLOWED.items() if "demo" in v and k != "demo"] == []
    # the forecast has one home; `diagnose forecast` is its command
    assert sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*forecast*")) == ["eagle3/tools/forecast.py"]


def test_the_checker_sees_a_sideways_import(tmp_path):
    # The rules above pass vacuously if the parser missed imports: feed it known cases.
    assert not allowed("eagle3.stages.s05_export.run", "eagle3.stages.s02_extract.run")
    assert not allowed("eagle3.drafter.model", "eagle3.stages.s03_vocab.run")
    assert not allowed("eagle3.engines.vllm_engine", "eagle3.stages.s06_evaluate.engine")
    assert not allowed("eagle3.stages.s04_train.run", "eagle3.demo.summary")
    assert not allowed("eagle3.tools.window_loop", "eagle3.demo.tiny")
    assert not allowed("eagle3.serving.model_card", "eagle3.demo.summary")
    assert not allowed("eagle3.demo.tiny", "eagle3.tools.diagnose")
    assert allowed("eagle3.demo.summary", "eagle3.stages.s06_evaluate.report")
    assert allowed("eagle3.stages.s04_train.run", "eagle3.stages.s04_train.data")
    assert allowed("eagle3.stages.configs", "eagle3.stages.s04_train.config")
    assert not allowed("eagle3.stages.configs", "eagle3.stages.s04_train.run")
    assert not allowed("eagle3.stages.s04_train.run", "eagle3.stages.configs")
    assert allowed("eagle3.tools.forecast", "eagle3.stages.s04_train.run")
    # between the concepts: downwards only
    assert not allowed("eagle3.core.config", "eagle3.artifacts.workdir")
    assert allowed("eagle3.core.cli", "eagle3.artifacts.manifest")
    assert not allowed("eagle3.artifacts.manifest", "eagle3.core.cli")
    assert not allowed("eagle3.artifacts.train_outputs", "eagle3.drafter.model")
    assert not allowed("eagle3.artifacts.vocab_map", "eagle3.target.info")
    assert not allowed("eagle3.target.info", "eagle3.artifacts.workdir")
    assert not allowed("eagle3.drafter.model", "eagle3.serving.engine_rules")
    assert allowed("eagle3.serving.drafter_io", "eagle3.drafter.model")
    assert not allowed("eagle3.serving.drafter_io", "eagle3.engines.config")
    assert not allowed("eagle3.newpackage.x", "eagle3.core.errors")
    f = tmp_path / "m.py"
    f.write_text("from eagle3.core import store\n\ndef f():\n    from eagle3.drafter.model import DrafterConfig\n")
    assert our_imports(f) == [("eagle3.core", 1, False), ("eagle3.drafter.model", 4, True)]


def test_the_checker_fails_on_a_bad_import(tmp_path):
    # A tree whose artifacts import the drafter (upwards): the check must name that line, and only it.
    for rel, text in {"eagle3/__init__.py": "",
                      "eagle3/artifacts/__init__.py": "",
                      "eagle3/artifacts/manifest.py": "import json\n\nfrom eagle3.core.errors import PipelineError\n"
                                                      "from eagle3.drafter.model import DrafterConfig\n",
                      "eagle3/drafter/model.py": "from eagle3.artifacts.vocab_map import target_ids\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert violations(tmp_path) == ["eagle3/artifacts/manifest.py:4 imports eagle3.drafter.model"]
    # and a rule table with a loop in it is caught
    assert cycle({"core": {"core"}, "artifacts": {"core", "serving"}, "serving": {"artifacts"}}) == [
        "artifacts", "serving", "artifacts"]


def test_the_module_graph_sees_a_circle_through_a_submodule_and_a_function(tmp_path):
    # A circle of three: a package's submodule named in `from ... import`, a plain `import`,
    # and an import inside a function; plus a name imported from a package's __init__.py.
    for rel, text in {"eagle3/__init__.py": "",
                      "eagle3/stage/__init__.py": "VALUE = 1\n",
                      "eagle3/stage/run.py": "from eagle3.stage import steps, VALUE\n",
                      "eagle3/stage/steps.py": "import eagle3.stage.results\n",
                      "eagle3/stage/results.py": "def write():\n    from eagle3.stage.run import VALUE\n",
                      "eagle3/stage/alone.py": "import json\nfrom eagle3.stage.steps import x\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = module_graph(tmp_path)
    assert graph["eagle3.stage.run"] == {"eagle3.stage", "eagle3.stage.steps"}
    assert graph["eagle3.stage.alone"] == {"eagle3.stage.steps"}
    assert cycle(graph) == ["eagle3.stage.steps", "eagle3.stage.results", "eagle3.stage.run",
                            "eagle3.stage.steps"]


def stage_package(stage) -> str:
    """'eagle3.stages.s04_train': a stage's package, named by its number and key."""
    return f"eagle3.stages.s{stage.number}_{stage.key}"


def test_the_stage_folders_are_the_registry_in_order():
    folders = sorted(p.name for p in (PACKAGE / "stages").iterdir() if (p / "__init__.py").is_file())
    assert folders == [stage_package(s).rsplit(".", 1)[1] for s in STAGES]
    for i, s in enumerate(STAGES):
        assert s.number == f"{i:02d}" and s.folder.startswith(s.number) and s.script.startswith(s.number)


# The stages that start vLLM: its spawned workers re-import the main module, so their scripts
# import the stage only under `if __name__ == "__main__":`.
STARTS_VLLM = {"generate", "extract", "evaluate"}


def script_imports(path: Path) -> dict[str, tuple[set[str], bool]]:
    """module -> (names imported from it, whether under `if __name__ == "__main__":`) in a script."""
    tree = ast.parse(path.read_text())
    guarded = {id(sub) for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for sub in ast.walk(node)}
    return {node.module: ({alias.name for alias in node.names}, id(node) in guarded)
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def runs_its_stage(path: Path, stage) -> list[str]:
    """What a numbered script lacks to follow it to its stage's code by import, or []."""
    package = stage_package(stage)
    imports = script_imports(path)
    problems = [f"does not import from {package}.{part}" for part in ("config", "run")
                if f"{package}.{part}" not in imports]
    if problems:
        return problems
    config_names, entry_names = imports[f"{package}.config"][0], imports[f"{package}.run"][0]
    if STAGE_CONFIGS[stage.key].__name__ not in config_names:
        problems.append(f"does not import {STAGE_CONFIGS[stage.key].__name__} from {package}.config")
    calls = [[ast.literal_eval(arg) if isinstance(arg, ast.Constant) else ast.unparse(arg) for arg in node.args[:3]]
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_stage"]
    config_name = STAGE_CONFIGS[stage.key].__name__
    if len(calls) != 1 or calls[0][:2] != [config_name, stage.key] or calls[0][2] not in entry_names:
        problems.append(f"does not call run_stage({config_name}, \"{stage.key}\", <an entry imported from "
                        f"{package}.run>, ...) once")
    if stage.key in STARTS_VLLM:
        problems += [f"imports {module} outside `if __name__ == \"__main__\":`, where vLLM's workers re-import it"
                     for module, (_, guarded) in imports.items() if module.startswith("eagle3") and not guarded]
    return problems


@pytest.mark.parametrize("stage", STAGES, ids=[s.key for s in STAGES])
def test_each_script_imports_its_stage_s_config_and_entry(stage):
    assert STAGE_CONFIGS[stage.key].__module__ == f"{stage_package(stage)}.config"
    problems = runs_its_stage(ROOT / stage.script, stage)
    assert not problems, f"{stage.script}: " + "; ".join(problems)
    entry_names = script_imports(ROOT / stage.script)[f"{stage_package(stage)}.run"][0]
    run_module = importlib.import_module(f"{stage_package(stage)}.run")
    assert all(callable(getattr(run_module, name)) for name in entry_names)


def test_the_script_check_sees_a_name_string(tmp_path):
    # The registry's old way in: a key string and an importlib lookup; the check must refuse it.
    script = tmp_path / "04_train_drafter.py"
    script.write_text('from eagle3.core.cli import stage_main\n\nif __name__ == "__main__":\n'
                      '    stage_main("train", __doc__)\n')
    train = next(s for s in STAGES if s.key == "train")
    assert runs_its_stage(script, train) == ["does not import from eagle3.stages.s04_train.config",
                                             "does not import from eagle3.stages.s04_train.run"]
    # and a vLLM stage's script that imports its stage at the top is refused
    script.write_text("from eagle3.core.cli import run_stage\nfrom eagle3.stages.configs import STAGE_CONFIGS\n"
                      "from eagle3.stages.s02_extract.config import ExtractConfig\n"
                      "from eagle3.stages.s02_extract.run import extract_hidden_states\n\n"
                      'if __name__ == "__main__":\n'
                      '    run_stage(ExtractConfig, "extract", extract_hidden_states, __doc__,\n'
                      '              sections=STAGE_CONFIGS)\n')
    extract = next(s for s in STAGES if s.key == "extract")
    assert [problem.split(" outside")[0] for problem in runs_its_stage(script, extract)] == [
        "imports eagle3.core.cli", "imports eagle3.stages.configs", "imports eagle3.stages.s02_extract.config",
        "imports eagle3.stages.s02_extract.run"]

"""Stage 06's engine worker (eagle3/stages/s06_evaluate/engine.py) runs this checkout's code,
whatever directory stage 06 is started from."""
import subprocess

from eagle3.stages.s06_evaluate.engine import _engine_env, _worker_cmd


def test_the_worker_imports_this_checkout_even_from_inside_another(tmp_path):
    """Started from a folder holding another `eagle3` (a second checkout), `python -m` put that
    folder ahead of the PYTHONPATH naming this checkout: the worker served with the other code."""
    decoy = tmp_path / "eagle3"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('the other checkout was imported')\n")
    missing = tmp_path / "missing-request.json"
    proc = subprocess.run(_worker_cmd(missing, tmp_path / "out.json"), cwd=tmp_path, env=_engine_env(),
                          capture_output=True, text=True, timeout=300)
    assert "the other checkout was imported" not in proc.stderr
    assert proc.returncode != 0 and "missing-request.json" in proc.stderr  # this checkout's worker, reading it

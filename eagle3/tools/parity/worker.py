"""One engine's side of the parity check, in its own process: `python -m eagle3.tools.parity.worker REQUEST.json`.

Started by eagle3/tools/parity/check.py (`run_workers`) with the engine's python: the global
one for vLLM, `.venv-sglang/bin/python` for SGLang. Reads the request (eagle3/tools/parity/protocol.py),
runs every case and capture of it in this one process, writes each result beside the path
the request names, and exits 0; a case the engine refuses (its config reader or weight
loader raises) is a result too, with the error. Exit status 2 when the engine itself cannot
be imported or set up, with the reason on stderr.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

from eagle3.tools.parity import protocol, sglang_side, vllm_side  # neither imports its engine at import


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    request = protocol.read_json(argv[0])
    engine = request["engine"]
    logging.basicConfig(level=logging.WARNING)
    # the one-rank process group listens on a port: a free one, so parallel runs never collide
    os.environ.setdefault("EAGLE3_PARITY_PORT", str(_free_port()))
    try:
        if engine == "vllm":
            side = vllm_side
            versions = {"vllm": __import__("vllm").__version__}
        else:
            side = sglang_side
            state = side.setup()
            versions = {"sglang": state["version"], "stubbed": state["stubbed"]}
    except Exception:  # noqa: BLE001 - any failure to bring the engine up is reported whole
        sys.stderr.write(f"cannot import or set up {engine} with {sys.executable}:\n{traceback.format_exc()}")
        return 2
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix=f"parity-{engine}-") as scratch:
        for i, case in enumerate(request.get("cases", [])):
            tensors, facts = side.run_case(case, Path(scratch) / f"case{i}")
            protocol.write_result(case["out"], tensors, {**facts, "versions": versions})
        for capture in request.get("captures", []):
            tensors, facts = side.capture(capture)
            protocol.write_result(capture["out"], tensors, {**facts, "versions": versions})
    return 0


if __name__ == "__main__":
    sys.exit(main())

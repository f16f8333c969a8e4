"""`python -m eagle3.stages.s06_evaluate --serve REQUEST.json RESULT.json`: one engine run of stage 06 in its own
process (started by the stage; see eagle3/stages/s06_evaluate/engine.py)."""
import sys

from eagle3.stages.s06_evaluate.engine import serve_main

if len(sys.argv) == 4 and sys.argv[1] == "--serve":
    sys.exit(serve_main(sys.argv[2:]))
sys.exit("usage: python -m eagle3.stages.s06_evaluate --serve REQUEST.json RESULT.json "
         "(internal; run stage 06 with 06_evaluate_drafter.py)")

"""Stage 06: measure the exported drafter in a real engine (see eagle3/evaluate/run.py)."""
from .run import *  # noqa: F401,F403
from .run import __all__  # noqa: F401

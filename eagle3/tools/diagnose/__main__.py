"""`python -m eagle3.tools.diagnose ...` (eagle3/tools/diagnose/__init__.py `main`)."""
import sys

from eagle3.tools.diagnose import main

sys.exit(main())

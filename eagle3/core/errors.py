"""The one exception type for bad user input.

Library code raises `PipelineError` for anything a user can fix (a wrong flag, a
missing stage, a mismatched artifact). The message names the file, the value and
the fix; the CLI prints it without a traceback and exits with status 2. Internal
invariants use `assert` instead.
"""


class PipelineError(Exception):
    """Bad input that the user can fix; the message says how."""

"""A training script that imports only the standard library: where a test's subject is the
command line (tests/test_cli_errors.py), the launcher's warm server then imports nothing
(launcher/preload.py) and an error is told in a second, not after torch's import."""

import sys

print("trained", sys.argv[1:])

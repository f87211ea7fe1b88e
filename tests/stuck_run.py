"""A run that never ends, for tests/test_suite_hygiene.py: starts a child of its own, says so in
`STARTED_DIR/<pid>`, and sleeps. Both carry TOKEN in their command lines, so the test can count them.

    python -m tests.stuck_run TOKEN STARTED_DIR
"""
import os
import subprocess
import sys
import time

token, started = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", token])
open(os.path.join(started, str(os.getpid())), "w").write(str(child.pid))
time.sleep(600)

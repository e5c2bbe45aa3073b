"""Run a test script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before
Triton is imported, so such checks run in a subprocess), with the checkout on its path."""
from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)

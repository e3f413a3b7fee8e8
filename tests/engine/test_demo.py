"""``kvxfer demo`` (``make demo``) as a newcomer runs it: every turn after the first is served from kvxfer,
bit-exact against vLLM alone, and the daemon's status is printed."""

import os
import re
import subprocess
import sys


def test_the_demo_runs_and_says_what_it_shows():
    done = subprocess.run([sys.executable, "-m", "service.program", "demo", "--turns", "2"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["1", "2"], done.stdout
    assert all(row[-1] == "yes" for row in rows), done.stdout  # bit-exact against vLLM alone
    assert int(rows[1][6]) >= 1024, done.stdout  # turn 2: at least the system prompt came from kvxfer
    assert "kvxfer status" in done.stdout and "vllm-" in done.stdout

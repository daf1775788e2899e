"""The CLI piped into a reader that leaves early (`trainermon analyze RUN | head`)."""

from __future__ import annotations

import subprocess
import sys

# A command whose output outgrows the pipe's buffer: the CLI's own entry point, one command replaced
FLOOD = """
import sys
from trainermon import cli

def flood(args):
    for i in range(200000):
        print("row", i)
    return 0

cli._cmd_check_config = flood
sys.exit(cli.main(["check-config", "unused.json"]))
"""


def test_a_reader_that_leaves_early_gets_no_traceback():
    """Before: a BrokenPipeError traceback on stderr (and exit status 1) after `| head -1`."""
    child = subprocess.Popen(
        [sys.executable, "-c", FLOOD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "row 0\n"
    child.stdout.close()  # the reader leaves
    err = child.stderr.read()
    child.stderr.close()
    assert child.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err

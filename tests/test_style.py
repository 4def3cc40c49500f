"""The code is linted and formatted as pyproject.toml's ruff configuration says (ruff is pinned in
the test extra, since its formatter's output changes between versions)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]

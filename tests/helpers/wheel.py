"""The server distribution built as a wheel, as `pip install .` would build it."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_server_wheel(out: Path) -> Path:
    """Build the wheel from a copy of the sources (building writes build/ and *.egg-info next to
    them) into `out`; returns its path."""
    source = out / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__",
                                                                "tests", "bench", "docs"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True, timeout=300, cwd=out)
    assert build.returncode == 0, build.stderr
    (wheel,) = out.glob("nanovllm-*.whl")
    return wheel

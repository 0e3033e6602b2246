"""scripts/gpu_check.sh refuses to pass where there is no GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_check.sh")], check=True)


def test_without_a_gpu_it_fails_and_says_why(tmp_path):
    if torch.cuda.is_available():
        return  # on a GPU machine the script itself is the test
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 2
    assert "sees no CUDA device" in result.stderr

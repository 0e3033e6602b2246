"""``import workers`` turns on torch's huge-page allocations unless told otherwise."""

import os
import subprocess
import sys


def _value_after_import(env: dict) -> str:
    code = "import os, workers; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_workers_sets_the_allocator_flag_and_the_environment_wins():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert _value_after_import(env) == "1"
    assert _value_after_import({**env, "THP_MEM_ALLOC_ENABLE": "0"}) == "0"


def test_the_flag_is_set_before_torch_is_imported():
    # Torch reads the flag once, at its first allocation: importing workers must not import torch first.
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = "import sys, workers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

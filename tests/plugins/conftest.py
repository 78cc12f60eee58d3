"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, at collection time.
On a CUDA machine it is left unset (tests/gpu then runs the compiled kernels) and the
interpreter-mode tests below skip themselves.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

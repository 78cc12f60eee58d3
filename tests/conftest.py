"""Suite-wide test setup.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here, before any test
module can import triton: the plugin kernels then run on CPU in interpreter mode.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# One thread: the tiny test models are overhead-bound, and extra threads only add contention
# with the servers and MPI ranks the tests start on the same two cores.
torch.set_num_threads(1)

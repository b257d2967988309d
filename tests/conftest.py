"""Shared test setup. Triton kernels run under the interpreter wherever there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

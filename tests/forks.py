"""Tests that train in forked processes (ranks that inherit the loaded models: no import, no capture)."""
from __future__ import annotations

import os

import pytest
import torch


def autograd_survives_fork() -> bool:
    """Whether a process forked from this one can run a backward. On torch's CUDA builds (PyPI's default,
    with or without a GPU), a process that has run a backward after torch.export has started autograd's
    device threads, and the children it forks refuse autograd ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing"); the CPU build never starts them. Users' ranks are new
    processes (torchrun), so only these tests' forked ranks meet it."""
    pid = os.fork()
    if pid == 0:
        try:
            x = torch.ones(2, requires_grad=True)
            (x * 2).sum().backward()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def skip_unless_forked_ranks_train() -> None:
    """Skip a test whose forked ranks train where they cannot (autograd_survives_fork)."""
    if not autograd_survives_fork():
        pytest.skip(f"torch {torch.__version__}: a forked process cannot run autograd once this one has (a CUDA "
                    "build's device threads); the CPU build runs this test")

"""What the fork server of :mod:`gang.testing` imports once, before it forks any worker.

The fork server (``multiprocessing``'s ``forkserver`` start method) is a single-threaded process
that imports this module and then forks every :class:`~gang.testing.World` process from itself,
so that a worker starts with torch and gang already imported instead of importing them again
(about 1.7 s of CPU per process).

The rule: a process may fork only while it has one thread. Importing torch starts no thread, but
NumPy's OpenBLAS starts a pool at import unless told not to, so the thread counts are set to 1
here, before anything is imported (the workers use one thread each anyway). JAX is not imported
here: it reads part of its configuration from the environment at import, and a worker's
environment is set only after the fork.
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import torch.distributed.fsdp  # noqa: E402
import torch.distributed.tensor.parallel  # noqa: E402, F401

import gang.testing  # noqa: E402, F401

"""``python -m gang.bench``: how fast are the collectives on this machine or cluster, and what does the gang add?

Launch it as any distributed program, or let it start local processes itself::

    torchrun --nproc-per-node 8 -m gang.bench --out results.json     # one node, or --nnodes N
    srun --ntasks-per-node 8 python -m gang.bench --out results.json  # SLURM
    mpirun -np 8 python -m gang.bench --out results.json              # Open MPI
    python -m gang.bench --nproc 4 --quick --out results.json         # 4 local processes

Each collective (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``broadcast``) is timed at sizes from 4 bytes to 64 MiB (``--quick``: 4 MiB) through raw
``torch.distributed`` and through :class:`gang.ProcessGroupGang` on the same process group,
interleaved, and through the implementations that installed packages add (``gang_jax`` adds raw
JAX and :class:`gang_jax.JaxGang` on the CPU; see :func:`gang.bench.collectives.providers`).
gloo runs on the CPU and NCCL on ``cuda:LOCAL_RANK`` (each call is then followed by a CUDA
synchronisation, so the time covers the collective). ``--dtype`` picks the element type and
``--gang tp --tp 8`` (say) times one gang of a layout instead of every process.

Rank 0 shows progress on stderr and prints one nccl-tests-style table per collective (size,
count, type, then the mean, p50 and p95 time, algbw, busbw and ``#wrong`` per implementation,
then the gang/raw ratio), then a summary of the ratios and of the wrong results: every result is
checked against the expected values, and the exit status is 1 if any element was wrong.
``--out`` writes the JSON (environment, rows, summary) and, when matplotlib is importable, PNG
plots next to it. :mod:`gang.bench.metrics` defines the bandwidths and ratios.
"""

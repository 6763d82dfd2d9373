"""The GPU check: what one GPU can run of gang, gang-mesh and gang-jax, as one command.

Run it from the repository root on the machine that has the GPU, with that machine's own Python
(its torch and JAX are used as they are; nothing is downloaded)::

    python3 .ci/gpu_check.py            # installs the three packages (--no-deps), then the checks
    python3 .ci/gpu_check.py --cpu      # the same checks on the CPU and gloo (what CI runs)

It installs ``packages/gang``, ``packages/gang-mesh`` and ``packages/gang-jax`` with
``pip install --no-deps -e`` (or, where pip cannot build them offline, a ``.pth`` file naming their
source folders; ``--no-install`` skips that, and the checks import the source folders either way),
then runs each check in fresh processes on 127.0.0.1, each bounded by its own timeout:

* ``nccl_gang``: a NCCL gang of one (``create_default_process_group`` on ``cuda:0``): every
  collective, a sub-gang (``create_gang``) and a split, and async handles (``async_op=True``);
* ``gloo_cuda``: CUDA tensors through a gloo group of 2 processes wrapped with
  ``ProcessGroupGang.from_process_group``: every collective and a send/recv pair;
* ``work_polling``: ``Work.is_completed`` polled and ``Work.wait(timeout)`` for an all-reduce
  started on a side CUDA stream, its result read after ``wait`` on that stream;
* ``fsdp2``: FSDP2 (``fully_shard``) on one GPU through ``gang_mesh.to_device_mesh``, against
  ``init_device_mesh``: the same losses, bit for bit;
* ``jax_gang``: a ``JaxGang`` of one on the JAX the machine has (its device and backend recorded):
  a torch all-reduce and ``gang_jax.functional`` on a ``jax.Array`` on JAX's default device.

``--cpu`` runs the same checks with ``cpu`` for ``cuda``, gloo for NCCL and the default stream for
the side stream. The report (``--out``, default ``gpu_check.json``) holds each check's outcome, its
seconds and what it measured or the error; the last line printed is a one-line summary. The exit
status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gang", "gang-mesh", "gang-jax")
SOURCES = [str(ROOT / "packages" / name / "src") for name in PACKAGES]
CHECK_TIMEOUT = 90.0
"""Seconds each check may take (its processes are killed after that); five checks stay under 8 minutes."""


# The checks: each runs in its own processes as `fn(rank, world_size, cpu)` and returns what it measured.


def _device(cpu: bool) -> Any:
    import torch

    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def _every_collective(g: Any, device: Any) -> dict[str, Any]:
    """Every collective of ``g`` on ``device``, the results checked against what they must be."""
    import torch

    from gang import ReduceOperation

    n, r = g.size, g.rank
    t = torch.full((4,), float(r + 1), device=device)
    g.all_reduce(t, ReduceOperation.SUM)
    assert t.tolist() == [n * (n + 1) / 2] * 4, t
    out = torch.empty(n, 4, device=device)
    g.all_gather(out, torch.full((4,), float(r), device=device))
    assert out.flatten().tolist() == [float(i) for i in range(n) for _ in range(4)], out
    scattered = torch.empty(2, device=device)
    g.reduce_scatter(scattered, torch.ones(n, 2, device=device), ReduceOperation.SUM)
    assert scattered.tolist() == [float(n)] * 2, scattered
    exchanged = torch.empty(n, device=device)
    g.all_to_all(exchanged, torch.full((n,), float(r), device=device))
    assert exchanged.tolist() == [float(i) for i in range(n)], exchanged
    b = torch.full((3,), float(r), device=device)
    g.broadcast(b, source_rank=n - 1)
    assert b.tolist() == [float(n - 1)] * 3, b
    g.barrier()
    return {"size": n, "device": str(device)}


def nccl_gang(rank: int, world_size: int, cpu: bool) -> dict[str, Any]:
    import torch

    from gang import ProcessGroupGang, ReduceOperation

    device = _device(cpu)
    root = ProcessGroupGang.create_default_process_group(device)
    try:
        result = {"backend": str(torch.distributed.get_backend()), **_every_collective(root, device)}
        sub = root.create_gang([0])
        assert sub is not None
        _every_collective(sub, device)
        split = root.split([[0]])
        assert split is not None
        _every_collective(split, device)
        t = torch.ones(1 << 16, device=device)
        works = [root.all_reduce(t, ReduceOperation.SUM, async_op=True) for _ in range(3)]
        for work in works:
            assert work is not None
            work.wait()
        assert all(work.is_completed() for work in works if work is not None)
        out = torch.empty(1, 1 << 16, device=device)
        work = sub.all_gather(out, t, async_op=True)
        assert work is not None
        work.wait(timeout=60)
        assert work.is_completed()
        result["sub_gangs"] = 2
        return result
    finally:
        root.close()


def gloo_cuda(rank: int, world_size: int, cpu: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from gang import ProcessGroupGang

    device = _device(cpu)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        g = ProcessGroupGang.from_process_group(dist.group.WORLD, device)  # type: ignore[arg-type]
        result = {"backend": str(dist.get_backend()), **_every_collective(g, device)}
        peer = 1 - rank
        received = torch.empty(5, device=device)
        if rank == 0:
            g.send(torch.arange(5.0, device=device), peer)
            g.recv(received, peer)
        else:
            g.recv(received, peer)
            g.send(received * 2, peer)
        assert received.tolist() == ([0.0, 2.0, 4.0, 6.0, 8.0] if rank == 0 else [0.0, 1.0, 2.0, 3.0, 4.0]), received
        g.close()
        return result
    finally:
        dist.destroy_process_group()


def work_polling(rank: int, world_size: int, cpu: bool) -> dict[str, Any]:
    import contextlib

    import torch

    from gang import ProcessGroupGang, ReduceOperation

    device = _device(cpu)
    root = ProcessGroupGang.create_default_process_group(device)
    try:
        side = contextlib.nullcontext() if cpu else torch.cuda.stream(torch.cuda.Stream(device))  # type: ignore[no-untyped-call]
        polls = 0
        with side:
            t = torch.ones(1 << 20, device=device)
            work = root.all_reduce(t, ReduceOperation.SUM, async_op=True)
            assert work is not None
            deadline = time.monotonic() + 60
            while not work.is_completed():
                polls += 1
                assert time.monotonic() < deadline, "the all-reduce never completed"
                time.sleep(0.001)
            work.wait(timeout=10)
            total = float(t.sum().item())  # read on the stream that waited
        assert total == float(1 << 20), total
        return {"polls": polls, "side_stream": not cpu}
    finally:
        root.close()


def fsdp2(rank: int, world_size: int, cpu: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gang import ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs
    from gang_mesh import to_device_mesh

    device = _device(cpu)
    root = ProcessGroupGang.create_default_process_group(device)
    try:
        gangs = create_fsdp_gangs(create_parallel_gangs(root))
        ours = to_device_mesh(gangs, ("sdp",))
        reference = init_device_mesh(device.type, (world_size,), mesh_dim_names=("sdp",))

        def losses(mesh: Any) -> list[float]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            generator = torch.Generator().manual_seed(1)
            result = []
            for _ in range(5):
                x = torch.randn(8, 16, generator=generator).to(device)
                y = torch.randn(8, 4, generator=generator).to(device)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                optimizer.zero_grad()
                result.append(loss.item())
            return result

        mine, theirs = losses(ours), losses(reference)
        assert mine == theirs, f"{mine} != {theirs}"
        assert mine[-1] < mine[0], f"did not learn: {mine}"
        return {"losses": mine, "mesh_device": ours.device_type}
    finally:
        root.close()


def jax_gang(rank: int, world_size: int, cpu: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    from gang import ReduceOperation
    from gang_jax import JaxGang, functional

    g = JaxGang.create_default()
    try:
        t = torch.ones(4)
        g.all_reduce(t, ReduceOperation.SUM)
        assert t.tolist() == [float(world_size)] * 4, t
        x = jax.device_put(jnp.arange(4.0), jax.devices()[0])
        y = functional.all_reduce(g, x, ReduceOperation.SUM)
        assert y.tolist() == [0.0, world_size * 1.0, world_size * 2.0, world_size * 3.0], y
        return {
            "jax": jax.__version__,
            "default_backend": jax.default_backend(),
            "gang_device": str(g.jax_device),
            "input_device": str(x.devices()),
            "result_device": str(y.devices()),
        }
    finally:
        g.close()


CHECKS: dict[str, tuple[Callable[[int, int, bool], dict[str, Any]], int]] = {
    "nccl_gang": (nccl_gang, 1),
    "gloo_cuda": (gloo_cuda, 2),
    "work_polling": (work_polling, 1),
    "fsdp2": (fsdp2, 1),
    "jax_gang": (jax_gang, 1),
}
"""Each check and the number of processes it runs on."""


# The driver.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(name: str, rank: int, world_size: int, cpu: bool, out: Path) -> None:
    """Run check ``name`` as ``rank`` (in a process the driver started) and write its outcome to ``out``."""
    fn, _ = CHECKS[name]
    try:
        outcome: dict[str, Any] = {"ok": True, "result": fn(rank, world_size, cpu)}
    except BaseException as ex:  # reported, not raised: the driver reads every rank's file
        outcome = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "traceback": traceback.format_exc()}
    out.write_text(json.dumps(outcome, default=str))


def run_check(name: str, cpu: bool, folder: Path, timeout: float = CHECK_TIMEOUT) -> dict[str, Any]:
    """Run check ``name`` in its own processes and return its report entry."""
    _, world_size = CHECKS[name]
    port = _free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
        "OMP_NUM_THREADS": "1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # JAX takes GPU memory as it needs it, beside torch
        "PYTHONPATH": os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")]),
    }
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    started = time.monotonic()
    procs = []
    for rank in range(world_size):
        out = folder / f"{name}.{rank}.json"
        out.unlink(missing_ok=True)
        argv = [sys.executable, __file__, "--worker", name, "--rank", str(rank), "--result", str(out)]
        procs.append(
            subprocess.Popen(
                argv + (["--cpu"] if cpu else []),
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    logs, codes = [], []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output, _ = proc.communicate()
        logs.append(output.decode(errors="replace")[-4000:])
        codes.append(proc.returncode)
    seconds = round(time.monotonic() - started, 2)
    ranks = []
    for rank in range(world_size):
        out = folder / f"{name}.{rank}.json"
        missing = {"ok": False, "error": "no result (timed out or died)"}
        ranks.append(json.loads(out.read_text()) if out.exists() else missing)
    ok = all(r["ok"] for r in ranks) and all(code == 0 for code in codes)
    entry: dict[str, Any] = {"ok": ok, "seconds": seconds, "exit_codes": codes, "result": ranks[0].get("result")}
    if not ok:
        entry["errors"] = [r.get("error") for r in ranks]
        entry["tracebacks"] = [r.get("traceback") for r in ranks]
        entry["logs"] = logs
    return entry


def install() -> dict[str, Any]:
    """``pip install --no-deps -e`` the three packages into this Python, without a registry.

    pip builds them with the setuptools already installed (``--no-build-isolation``); where that
    fails (no setuptools, or one older than the packages' metadata needs), a ``gang-sources.pth``
    in this Python's ``site-packages`` puts the three source folders on its path instead (what an
    editable install does, without the distributions' metadata).
    """
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    argv += [arg for name in PACKAGES for arg in ("-e", str(ROOT / "packages" / name))]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    result: dict[str, Any] = {"command": " ".join(argv), "output": (done.stdout + done.stderr)[-2000:]}
    if done.returncode == 0:
        return {"ok": True, "method": "pip", **result}
    try:
        pth = Path(sysconfig.get_paths()["purelib"]) / "gang-sources.pth"
        pth.write_text("".join(f"{source}\n" for source in SOURCES))
    except OSError as ex:
        return {"ok": False, "method": "none", "pth_error": str(ex), **result}
    return {"ok": True, "method": f"pth ({pth})", **result}


def environment() -> dict[str, Any]:
    """What the checks ran on: Python, torch (its CUDA and NCCL), JAX, the GPU."""
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    try:
        import jax

        info["jax"] = jax.__version__
    except ImportError as ex:
        info["jax"] = f"not importable: {ex}"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU and gloo")
    parser.add_argument("--no-install", action="store_true", help="do not pip install the packages")
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run this check only (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report")
    parser.add_argument("--timeout", type=float, default=CHECK_TIMEOUT, help="seconds per check")
    parser.add_argument("--worker", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.rank, CHECKS[args.worker][1], args.cpu, args.result)
        return 0
    started = time.monotonic()
    report: dict[str, Any] = {"mode": "cpu" if args.cpu else "cuda"}
    if not args.no_install:
        report["install"] = install()
    report["environment"] = environment()
    folder = args.out.resolve().parent / ".gpu_check"
    folder.mkdir(parents=True, exist_ok=True)
    report["checks"] = {}
    for name in args.only or list(CHECKS):
        report["checks"][name] = entry = run_check(name, args.cpu, folder, args.timeout)
        print(f"{name}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s)", flush=True)
    report["seconds"] = round(time.monotonic() - started, 2)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    passed = [name for name, entry in report["checks"].items() if entry["ok"]]
    failed = [name for name in report["checks"] if name not in passed]
    env = report["environment"]
    installed = report.get("install", {"ok": True})["ok"]
    print(
        f"gpu_check {report['mode']}: {len(passed)}/{len(report['checks'])} passed"
        + (f", FAILED: {', '.join(failed)}" if failed else "")
        + ("" if installed else ", install FAILED (checks ran from the source folders)")
        + f" (torch {env['torch']}, jax {env['jax']}, {env.get('gpu', 'no GPU')}; {report['seconds']} s; {args.out})"
    )
    return 0 if not failed and installed else 1


if __name__ == "__main__":
    sys.exit(main())

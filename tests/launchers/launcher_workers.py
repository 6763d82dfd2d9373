"""A throwaway SLURM cluster on localhost: munged, slurmctld and two slurmd acting as two nodes.

Everything lives in a temporary folder (configuration, munge key and socket, spool, logs) and
uses free ports, so it never touches a system SLURM or munge. The daemons run in the
foreground as children of this process and are stopped (SIGTERM, then SIGKILL) by
:meth:`SlurmCluster.stop`, which also runs at interpreter exit.

The two nodes ``n1`` and ``n2`` are two ``slurmd -N`` processes on this machine (Debian's
slurm-wlm is built with multiple-slurmd support). Their names do not resolve in DNS; their
``NodeAddr`` is 127.0.0.1, which ``gang.launchers`` finds through ``scontrol show node``, as on a
cluster whose node names are not host names. Traps of slurm-wlm 22.05 in a container: slurmd
will not start without a cgroup plugin (``CgroupPlugin=cgroup/v1`` with
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` works), and two nodes may not
have a ``NodeHostname`` that is another node's name. Heterogeneous jobs need the backfill
scheduler (``sched/builtin`` refuses them: "Requested operation not supported on this system").
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from gang.testing import free_port

SBIN = os.pathsep.join(["/usr/sbin", "/sbin", "/usr/local/sbin"])
PROGRAMS = ("srun", "sbatch", "scontrol", "sinfo", "slurmctld", "slurmd", "munged", "mpirun", "torchrun")
NODES = ("n1", "n2")
CPUS_PER_NODE = 2  # so that `srun -n 4` spans both nodes without --ntasks-per-node
START_TIMEOUT_S = 60.0


def which(program: str) -> str | None:
    """Find ``program`` on ``PATH`` or in the sbin folders, where the daemons live."""
    return shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), SBIN]))


def missing_programs() -> list[str]:
    """The launcher programs this machine lacks."""
    return [program for program in PROGRAMS if which(program) is None]


class SlurmCluster:
    """Start with :meth:`start`; pass :attr:`env` to ``srun``/``sbatch``; stop with :meth:`stop`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gang-slurm-"))
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self._daemons: list[subprocess.Popen[bytes]] = []
        atexit.register(self.stop)

    def _write_config(self) -> None:
        r = self.root
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o711)
        key = r / "munge" / "key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        user = pwd.getpwuid(os.getuid()).pw_name
        host = socket.gethostname()
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={CPUS_PER_NODE}"
            for n in NODES
        )
        (r / "slurm.conf").write_text(
            f"""ClusterName=gangtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={r}/munge/socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=10 State=UP
"""
        )
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _spawn(self, *args: str) -> None:
        program = which(args[0])
        assert program is not None, args[0]
        log = open(self.root / "log" / f"{args[0]}-{len(self._daemons)}.out", "wb")  # noqa: SIM115
        self._daemons.append(subprocess.Popen([program, *args[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def start(self) -> SlurmCluster:
        """Start munged, slurmctld and one slurmd per node, and wait until every node is idle."""
        self._write_config()
        r = self.root / "munge"
        self._spawn(
            "munged", "--foreground", "--force", f"--key-file={r}/key", f"--socket={r}/socket",
            f"--pid-file={r}/pid", f"--log-file={r}/log", f"--seed-file={r}/seed",
        )  # fmt: skip
        self._wait_for(lambda: (r / "socket").exists(), "munged to create its socket")
        self._spawn("slurmctld", "-D", "-i")
        for node in NODES:
            self._spawn("slurmd", "-D", "-N", node)
        self._wait_for(self._nodes_idle, "both slurmd to register as idle nodes")
        return self

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return sorted(out.split()) == sorted([*NODES, *["idle"] * len(NODES)])

    def _wait_for(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():  # type: ignore[operator]
            dead = [d.args for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("log/*")))
                self.stop()
                raise RuntimeError(f"SLURM test cluster: timed out waiting for {what} (exited: {dead})\n{logs}")
            time.sleep(0.2)

    def run(self, command: list[str], *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client (``srun``, ``sbatch``, ...) against this cluster."""
        program = which(command[0]) or command[0]
        return subprocess.run(
            [program, *command[1:]], env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def stop(self) -> None:
        """Cancel what still runs, stop every daemon this object started, and delete its folder."""
        if self._daemons and self._daemons[1:2] and self._daemons[1].poll() is None:
            self.run(["scancel", "--user", pwd.getpwuid(os.getuid()).pw_name], check=False, timeout=30)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        self._kill_orphans()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_orphans(self) -> None:
        """Kill what outlived the daemons: a ``slurmstepd`` whose job was being revoked when slurmd stopped.

        Only processes that run under this cluster's ``SLURM_CONF`` (which slurmd hands to every
        step) are touched; they are this cluster's by construction.
        """
        mine = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        for proc in Path("/proc").glob("[0-9]*"):
            if int(proc.name) == os.getpid():
                continue
            try:
                if mine in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue  # Gone, or not ours to read.

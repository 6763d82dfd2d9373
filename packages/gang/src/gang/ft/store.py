"""The coordination store of :mod:`gang.ft`: ``python -m gang.ft.store --port P``.

It serves torch's ``TCPStore`` (the server side only; no training process hosts it) until it is
killed (``SIGTERM``/``SIGINT`` end it cleanly). It holds only soft state: killed and started again
on the same port within the replicas' ``quorum_timeout``, it lets training go on (every process
reconnects, registers again and re-joins its round; a step whose vote was in flight is not
committed on the processes that had not read its decision, and they heal at the next step).
Every replica reaches it at ``GANG_FT_STORE=host:P``.
With ``--port 0`` the system picks a free port. Once the store listens, it prints one line
``GANG_FT_STORE=<host>:<port>`` to standard output and writes ``<host>:<port>`` to ``--port-file``
if given, so a launcher can wait.

It listens on ``127.0.0.1`` unless told otherwise: a job on one machine stays on loopback. A job
whose replicas run on several hosts chooses ``--host 0.0.0.0`` (every IPv4 interface; ``::`` for
every interface), and the printed host is then this machine's name, or ``--host <address>`` (one
interface, printed as it is).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from gang._torch_groups import serve_store
from gang.ft.quorum import STARTED


def serve(port: int, *, host: str = "127.0.0.1", port_file: Path | None = None) -> None:
    """Serve a ``TCPStore`` on ``host:port`` until ``SIGTERM`` or ``SIGINT``.

    :param port: The port to listen on; ``0`` picks a free one (printed on standard output).
    :param host: The address to listen on (``0.0.0.0`` or ``::``: every interface, and the printed
        host is this machine's name).
    :param port_file: If given, the ``host:port`` line is also written to this file.
    """
    store = serve_store(host, port, timeout=timedelta(seconds=30))
    store.set(STARTED, f"{time.time():.6f}")  # replicas wait for each other to register again after a restart
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    address = f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{store.port}"
    line = f"GANG_FT_STORE={address}"
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(address + "\n")
        tmp.replace(port_file)
    print(line, flush=True)
    while not stop.wait(3600):
        pass
    del store


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve the store."""
    parser = argparse.ArgumentParser(prog="python -m gang.ft.store", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0: pick a free one)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every interface, multi-host)",
    )
    parser.add_argument("--port-file", type=Path, default=None, help="also write host:port to this file")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"`--port` must be in the range [0, 65536), but is {args.port} instead.")
    serve(args.port, host=args.host, port_file=args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

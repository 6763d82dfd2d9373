"""Run under torchrun on test hosts: ``launch_worker``'s checks, then one FSDP2 + TP step on the
gang mesh against ``init_device_mesh``'s, and where this process's gloo and JAX sockets live.

Usage: ``python torchrun_worker.py OUT`` (torchrun's ``GROUP_RANK`` numbers the node). Writes
``OUT/torchrun-<rank>.json`` (``launch_worker``'s result) and ``OUT/parity-<rank>.json``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import launch_worker
import parity_workers

import gang


def main() -> None:
    out = Path(sys.argv[1])
    sys.argv = [sys.argv[0], str(out), "torchrun", "--tp", "2", "--node-var", "GROUP_RANK"]
    launch_worker.main()  # the default gang, the layouts with tp inside a node, JaxGang

    root = gang.create_default_gang()
    result = parity_workers.parity(root, ("dp", "tp"), 2, None, 1)
    result["host"] = socket.gethostname()
    root.close()
    (out / f"parity-{gang.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Transfer benchmark: now `kvray bench` (kvray/bench/), which measures kvray's shm and ray
transports against memcpy, Ray's object store, Ray Direct Transport (gloo) and NIXL/UCX on the
same workloads, verifying every destination byte. This script only forwards to it:

    python benchmarks/bench_transfer.py [--quick] [--repeat N] [--json PATH] [--plot PATH] ...
"""

from __future__ import annotations

import sys

from kvray.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

"""Process-wide test settings, applied before anything imports Ray."""

import os

# Ray reads this at import time. With it off, every node of a test cluster (and the driver)
# uses the loopback address; otherwise a second node on this machine binds eth0's address and
# hangs connecting to the head.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

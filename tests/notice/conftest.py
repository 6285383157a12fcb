"""Fixtures of the notice channel tests. Some tests here drive real transports between two agents
and reuse the transport suite's builders (`test_contract`, `test_verbs_agents`): its folder is put
on the import path, as pytest does for the folder of a test it collects."""

import sys
from pathlib import Path

_TRANSPORT_TESTS = str(Path(__file__).resolve().parents[1] / "transport")
if _TRANSPORT_TESTS not in sys.path:
    sys.path.insert(0, _TRANSPORT_TESTS)

"""The agent: what an engine embeds to take part in kvray (steps three to seven of the data flow).

directory   registration with the coordinator, peers and their cache
transports  the transports an agent writes and receives through, and the choice per peer
push        plan, write, notify: whole requests and layer-wise
receive     expected requests, incoming writes and notices, `wait_for_kv`, release
kvagent     `KVAgent`, the facade over them
handoff     P/D hand-offs: a decode engine asks a prefill engine to push (any engine integration)
"""

from kvray.agent.directory import DirectoryService, RemoteDirectory
from kvray.agent.engine import Blocks
from kvray.agent.kvagent import KVAgent
from kvray.agent.push import PushResult
from kvray.agent.receive import Completion

__all__ = [
    "Blocks",
    "Completion",
    "DirectoryService",
    "KVAgent",
    "PushResult",
    "RemoteDirectory",
]

"""The data plane: rows held by key outside the driver (client interface and its adapters).

client.py          DataPlaneClient (register, put/get by key and field, clear, close)
in_process.py      a dictionary in this process (tests without Ray)
transfer_queue.py  the TransferQueue package on a Ray cluster (imported when used)
build.py           build_client(config): the adapter a `data_plane:` section names
"""

from policyworker._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "DataPlaneClient": "policyworker.shell.data_plane.client",
        "DataPlaneError": "policyworker.shell.data_plane.client",
        "InProcessDataPlane": "policyworker.shell.data_plane.in_process",
        "TransferQueueDataPlane": "policyworker.shell.data_plane.transfer_queue",
        "build_client": "policyworker.shell.data_plane.build",
    },
)

"""`build_client(config)`: the data-plane adapter a `data_plane:` section names."""

from __future__ import annotations

from policyworker.config.sections import DataPlaneConfig
from policyworker.shell.data_plane.client import DataPlaneClient
from policyworker.shell.data_plane.in_process import shared_in_process

__all__ = ["build_client"]


def build_client(config: DataPlaneConfig, *, bootstrap: bool = True) -> DataPlaneClient:
    """The client of `config.impl`: `bootstrap=True` in the driver (starts TransferQueue's
    actors), False in workers (attach to the running ones)."""
    if config.impl == "in_process":
        return shared_in_process()
    from policyworker.shell.data_plane.transfer_queue import TransferQueueDataPlane

    return TransferQueueDataPlane(config, bootstrap=bootstrap)

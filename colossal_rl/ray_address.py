"""What ``--master_address`` means to Ray: the ``ray.init(address=...)`` of the cluster a run joins.

Checked by the command line before Ray starts, used by the driver when it starts Ray; imports nothing.
"""

from __future__ import annotations

RAY_DEFAULT_PORT = 6379
"""The port ``ray start --head`` listens on unless given ``--port``."""


def ray_address(master_address: str) -> str:
    """The ``ray.init(address=...)`` of ``--master_address``: ``host`` -> ``host:6379``; ``host:port``,
    ``[ipv6]:port``, ``auto`` and ``ray://...`` (Ray Client) are kept; a bare IPv6 address gets brackets."""
    address = master_address.strip()
    if not address:
        raise ValueError("--master_address is empty")
    if address == "auto" or "://" in address:
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{RAY_DEFAULT_PORT}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{RAY_DEFAULT_PORT}"
    if ":" in address:
        host, port = address.rsplit(":", 1)
        if not host or not port.isdigit():
            raise ValueError(f"--master_address {master_address!r}: expected host or host:port")
        return address
    return f"{address}:{RAY_DEFAULT_PORT}"

"""The network interface gloo and NCCL open their sockets on, across nodes.

Left alone, gloo picks the address its host name resolves to and NCCL the first
interface it likes; on a machine with several networks either may choose one the
other nodes cannot reach. atom therefore names the interface: the one given with
`--dist-interface`, else the one this machine would use to reach node 0.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from atom.distributed.node_layout import NodeLayout, NodeLayoutError
from atom.distributed.rank_process import SOCKET_IFNAME_VARIABLES, loopback_interface

logger = logging.getLogger(__name__)

# linux/sockios.h: read an interface's IPv4 address.
SIOCGIFADDR = 0x8915


def source_address(master_addr: str, master_port: int) -> str:
    """The local address the routing table picks for traffic to node 0 (a UDP
    connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        raise NodeLayoutError(
            f"--master-addr {master_addr!r} does not resolve: {error}"
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 `address`, if any (IPv6: None,
    left to gloo / NCCL or --dist-interface)."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return loopback_interface()
    if ip.version != 4:
        return None
    packed = socket.inet_aton(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if reply[20:24] == packed:
                return name
    return None


def use_node_interface(layout: NodeLayout) -> str | None:
    """Point gloo and NCCL at the interface towards node 0 (rank processes inherit
    the variables); return its name. `--dist-interface` wins over the variables,
    and variables the user set win over the guess."""
    if layout.dist_interface:
        if layout.dist_interface not in {n for _, n in socket.if_nameindex()}:
            raise NodeLayoutError(
                f"--dist-interface {layout.dist_interface!r} is not an interface of "
                "this machine"
            )
        for variable in SOCKET_IFNAME_VARIABLES:
            os.environ[variable] = layout.dist_interface
        chosen = layout.dist_interface
    else:
        guess = interface_of(source_address(layout.master_addr, layout.master_port))
        if guess is not None:
            for variable in SOCKET_IFNAME_VARIABLES:
                os.environ.setdefault(variable, guess)
        chosen = os.environ.get(SOCKET_IFNAME_VARIABLES[0], guess)
    logger.info(
        "node %d: gloo / NCCL sockets on interface %s",
        layout.node_rank,
        chosen or "(their own choice)",
    )
    return chosen

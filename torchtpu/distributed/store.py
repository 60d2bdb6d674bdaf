"""A c10d ``TCPStore`` that listens on the group's address only.

``init_process_group(init_method="tcp://host:port")`` makes rank 0's store listen on every
interface whatever ``host`` is. Here rank 0 binds the listening socket to ``host`` itself and hands
it to the store (``master_listen_fd``), so a group on ``127.0.0.1`` is reachable from this host only
and one on a node address from that network only.
"""

from __future__ import annotations

import datetime
import socket
from urllib.parse import urlsplit

import torch.distributed as dist


def parse_tcp_init_method(init_method: str) -> tuple:
    """``(host, port)`` of a ``tcp://host:port`` init method; a ValueError naming it otherwise."""
    u = urlsplit(init_method)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise ValueError(f"expected an init method tcp://host:port, got {init_method!r}")
    return u.hostname, u.port


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1024)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} for the process group's store: {e.strerror}") from e
    return s


def bound_tcp_store(host: str, port: int, world_size: int, rank: int, timeout_s: float) -> dist.TCPStore:
    """The group's store: rank 0 serves it on ``host:port`` only; the others connect there."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        s = listen_socket(host, port)
        # the store owns the descriptor from here on (closed with the store)
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=s.detach())
    return dist.TCPStore(host, port, world_size, False, timeout)


def init_process_group_bound(backend: str, init_method: str, world_size: int, rank: int,
                             timeout: datetime.timedelta, **kwargs) -> None:
    """``dist.init_process_group`` over a :func:`bound_tcp_store` for a ``tcp://`` init method."""
    host, port = parse_tcp_init_method(init_method)
    store = bound_tcp_store(host, port, int(world_size), int(rank), timeout.total_seconds())
    dist.init_process_group(backend=backend, store=store, world_size=int(world_size), rank=int(rank),
                            timeout=timeout, **kwargs)

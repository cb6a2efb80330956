"""Host or reach the job's ``torch.distributed.TCPStore`` at ``master_addr:master_port``.

`open_store` decides who hosts: a single-node job and ``--node_rank 0`` always host (a clear
error when they cannot: port taken, or ``master_addr`` is not this machine); ``--node_rank -1``
hosts when `probe_bind` can bind ``master_addr:master_port`` (this machine, free port) and
joins as a client otherwise; other node ranks join. A client first waits, with plain TCP
connects (`_wait_reachable`), until the host listens, so the wait honours
``--cluster_time_out`` and signals, and torch's connection retries never flood the terminal.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import threading
import time
from collections.abc import Callable

from shardwise._torch.c10d import TCPStore
from shardwise.launch.config import LaunchConfig
from shardwise.launch.errors import LauncherInterrupted, RendezvousError
from shardwise.launch.schedlog import SchedulerLog

STORE_TIMEOUT_S = 60.0

StopCheck = Callable[[], "int | None"]
"""Returns the number of a stop signal the launcher received, or None."""


def open_store(
    cfg: LaunchConfig, log: SchedulerLog, deadline: float, stop: StopCheck
) -> tuple[TCPStore, bool]:
    """Host the job's store, or connect to it (see the module docstring for who hosts).

    Args:
        cfg: the launcher's options.
        log: the scheduler log.
        deadline: `time.monotonic()` value after which a client gives up waiting for the host.
        stop: polled while waiting; a signal number aborts.

    Returns:
        ``(store, hosting)``.

    Raises:
        RendezvousError: cannot host where required, or the host never listened.
        LauncherInterrupted: a stop signal arrived while waiting.

    Example:
        >>> store, hosting = open_store(cfg, log, time.monotonic() + 60, lambda: None)
    """
    ip = resolve_addr(cfg.master_addr)
    if cfg.single_node or cfg.node_rank <= 0:
        err = probe_bind(ip, cfg.master_port)
        must_host = cfg.single_node or cfg.node_rank == 0
        if err and must_host:
            raise _bind_error(cfg, err)
        server = None if err else _host_store(cfg, log, must_host)
        if server is not None:
            return server, True
        if err:  # (--node_rank -1: another launcher hosts it, or a program holds the port)
            where = f"{cfg.master_addr}:{cfg.master_port}"
            log.info(f"cannot host the store at {where} ({os.strerror(err)}); joining it")
    _wait_reachable(cfg, ip, deadline, stop)
    return _connect_client(cfg, deadline, stop), False


def _connect_client(cfg: LaunchConfig, deadline: float, stop: StopCheck) -> TCPStore:
    """The client of the store at ``master_addr:master_port``, made in a thread so that the
    wait honours the deadline and signals: torch's client waits for the host's answer with no
    limit (a program on the port that is not a store, a stuck host), inside C++."""
    made: list[TCPStore | BaseException] = []

    def connect() -> None:
        try:
            limit = datetime.timedelta(seconds=STORE_TIMEOUT_S)
            addr, port = cfg.master_addr, cfg.master_port
            made.append(TCPStore(addr, port, is_master=False, timeout=limit))
        except BaseException as e:  # (handed to the launcher's thread)
            made.append(e)

    thread = threading.Thread(target=connect, name="store-client", daemon=True)
    thread.start()
    while True:
        thread.join(0.2)
        if not thread.is_alive():
            break
        signum = stop()
        if signum is not None:
            raise LauncherInterrupted(signum)
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{cfg.master_addr}:{cfg.master_port} accepts connections but did not answer "
                f"as a rendezvous store within {cfg.cluster_time_out:g} s: another program "
                "listens on that port (pick a free --master_port for every launcher of the "
                "job), or the launcher of node 0 is stuck"
            )
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def probe_bind(ip: str, port: int) -> int:
    """Try to bind ``ip:port`` (then release it) to learn whether this machine can host there.

    Args:
        ip: a numeric address.
        port: the TCP port.

    Returns:
        0 when the bind works, else its errno (``EADDRINUSE``: the port is taken;
        ``EADDRNOTAVAIL``: `ip` is not an address of this machine).

    Example:
        >>> probe_bind("127.0.0.1", 0)
        0
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.errno or errno.EINVAL
    return 0


def resolve_addr(addr: str) -> str:
    """The numeric address of `addr` (a host name or an IP).

    Raises:
        RendezvousError: the name does not resolve.

    Example:
        >>> resolve_addr("127.0.0.1")
        '127.0.0.1'
    """
    try:
        return str(socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except socket.gaierror as e:
        raise RendezvousError(f"--master_addr {addr!r} does not resolve ({e.strerror})") from None


def _bind_error(cfg: LaunchConfig, err: int) -> RendezvousError:
    who = (
        "a single-node job (--local_worker_num == --worker_num)"
        if cfg.single_node
        else "--node_rank 0"
    )
    where = f"{cfg.master_addr}:{cfg.master_port}"
    if err == errno.EADDRINUSE:
        return RendezvousError(
            f"cannot host the rendezvous store: port {cfg.master_port} is in use on this "
            f"machine (another job?); {who} hosts it at {where}: pick a free --master_port"
        )
    if err == errno.EADDRNOTAVAIL:
        return RendezvousError(
            f"--master_addr {cfg.master_addr} is not an address of this machine, but {who} "
            f"hosts the rendezvous store here: give this machine's address (127.0.0.1 when "
            f"every launcher runs here)"
        )
    return RendezvousError(f"cannot host the rendezvous store at {where}: {os.strerror(err)}")


def _host_store(cfg: LaunchConfig, log: SchedulerLog, must_host: bool) -> TCPStore | None:
    try:
        return TCPStore(
            cfg.master_addr,
            cfg.master_port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        )
    except RuntimeError as e:
        if must_host:
            raise RendezvousError(
                f"cannot host the rendezvous store at {cfg.master_addr}:{cfg.master_port}: {e}"
            ) from None
        log.info(f"could not host the store ({e}); joining it as a client")
        return None


def _wait_reachable(cfg: LaunchConfig, ip: str, deadline: float, stop: StopCheck) -> None:
    while True:
        try:
            with socket.create_connection((ip, cfg.master_port), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"could not reach the rendezvous store at {cfg.master_addr}:{cfg.master_port} "
                f"within {cfg.cluster_time_out:g} s: start the launcher of node 0 (--node_rank 0, "
                f"or -1 on {cfg.master_addr}) with the same --master_port, and check the "
                "address and firewalls"
            )
        time.sleep(0.2)
        signum = stop()
        if signum is not None:
            raise LauncherInterrupted(signum)

"""A small TCP key-value store for order agreement, for engines without one.

torch.distributed brings its own store (c10d); MXNet's parameter servers only sum
what they receive and cannot hold rank 0's decisions, so the MXNet plugin has
worker 0 host this one. It carries control messages only, never gradients.
:class:`StoreServer` serves it (a thread per connection; a blocking ``get`` waits
on the server, never in a Python loop) and :class:`StoreClient` implements
:class:`commsched.store.Store` over it. Socket calls release the GIL, so a waiting
``get`` does not stall training threads.

Wire format, every integer big-endian: a request is an op byte (``S`` set, ``G``
get, ``C`` check, ``D`` delete a key and a queue of that name, ``Q`` push onto a
queue, ``P`` pop from a queue, ``A`` add to a counter), the key or queue name (u32
length + UTF-8), then for ``S`` and ``Q`` the value (u32 length + bytes), for ``G``
and ``P`` the timeout (f64 seconds) and for ``A`` the amount (i64). A reply is a
status byte (``+`` ok, ``-`` missing or timed out) and, for a successful ``G`` or
``P``, the value (u32 length + bytes), for ``A`` the counter's new value (i64).
"""

from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time

__all__ = ["StoreClient", "StoreServer"]

log = logging.getLogger(__name__)

_U32 = struct.Struct("!I")
_F64 = struct.Struct("!d")
_I64 = struct.Struct("!q")
_CONNECT_TIMEOUT_S = 30.0
_MAX_WAIT_S = 3600.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the commsched store connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_blob(sock: socket.socket) -> bytes:
    (length,) = _U32.unpack(_recv_exact(sock, 4))
    return _recv_exact(sock, length)


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


class StoreServer:
    """Serves a key-value store on ``(host, port)`` (port 0: any free port) until :meth:`close`.

    Threads: ``commsched-store-accept`` and one ``commsched-store-conn`` per
    client, all joined by :meth:`close`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._cv = threading.Condition()
        self._closing = False
        self._listener = socket.create_server((host, port), backlog=64)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="commsched-store-accept", daemon=False)
        self._accept_thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` where clients connect."""
        return self.host, self.port

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cv:
                if self._closing:
                    conn.close()
                    return
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conns.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="commsched-store-conn", daemon=False)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op = conn.recv(1)
                if not op:
                    return
                key = _recv_blob(conn).decode()
                if op == b"S":
                    value = _recv_blob(conn)
                    with self._cv:
                        self._data[key] = value
                        self._cv.notify_all()
                    conn.sendall(b"+")
                elif op == b"G":
                    (timeout,) = _F64.unpack(_recv_exact(conn, 8))
                    deadline = time.monotonic() + min(max(timeout, 0.0), _MAX_WAIT_S)
                    with self._cv:
                        while key not in self._data and not self._closing:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self._cv.wait(left)
                        value = self._data.get(key)
                    conn.sendall(b"-" if value is None else b"+" + _blob(value))
                elif op == b"Q":
                    value = _recv_blob(conn)
                    with self._cv:
                        self._queues[key].append(value)
                        self._cv.notify_all()
                    conn.sendall(b"+")
                elif op == b"P":
                    (timeout,) = _F64.unpack(_recv_exact(conn, 8))
                    deadline = time.monotonic() + min(max(timeout, 0.0), _MAX_WAIT_S)
                    value = None
                    with self._cv:
                        queue = self._queues[key]
                        while not queue and not self._closing:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self._cv.wait(left)
                        if queue:
                            value = queue.popleft()
                    conn.sendall(b"-" if value is None else b"+" + _blob(value))
                elif op == b"C":
                    with self._cv:
                        found = key in self._data
                    conn.sendall(b"+" if found else b"-")
                elif op == b"D":
                    with self._cv:
                        self._data.pop(key, None)
                        self._queues.pop(key, None)
                    conn.sendall(b"+")
                elif op == b"A":
                    (amount,) = _I64.unpack(_recv_exact(conn, 8))
                    with self._cv:
                        value = int(self._data.get(key, b"0")) + amount
                        self._data[key] = str(value).encode()
                        self._cv.notify_all()
                    conn.sendall(b"+" + _I64.pack(value))
                else:
                    log.error("commsched store: unknown request %r; closing the connection", op)
                    return
        except (OSError, ConnectionError):
            return  # client gone or server closing
        finally:
            conn.close()

    def num_keys(self) -> int:
        """Keys set plus values waiting in queues: what the store holds now (a soak checks it stays bounded)."""
        with self._cv:
            return len(self._data) + sum(len(q) for q in self._queues.values())

    def data_keys(self) -> int:
        """Keys set (values by key), without the queues."""
        with self._cv:
            return len(self._data)

    def queued_values(self) -> int:
        """Values waiting in queues (decisions a follower has not read yet: bounded, not constant)."""
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        """Stop serving: close every connection and join every thread. Safe to call twice."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(timeout=5.0)
        with self._cv:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5.0)
            if thread.is_alive():
                log.error("commsched store thread %s did not stop", thread.name)


class StoreClient:
    """:class:`commsched.store.Store` over a :class:`StoreServer`; one connection per calling
    thread, so a ``pop`` or ``get`` blocked on one thread never delays another's calls.

    ``get`` raises ``TimeoutError`` when the key does not appear in time; a lost
    server raises ``ConnectionError``.
    """

    def __init__(self, host: str, port: int, connect_timeout_s: float = _CONNECT_TIMEOUT_S) -> None:
        self.host = host
        self.port = int(port)
        self._connect_timeout_s = connect_timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    raise ConnectionError("this commsched store client is closed")
            sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.append(sock)
            self._local.sock = sock
        return sock

    def _call(self, request: bytes, timeout_s: float, read_value: bool = False) -> tuple[bool, bytes]:
        sock = self._sock()
        try:
            sock.settimeout(timeout_s + _CONNECT_TIMEOUT_S)
            sock.sendall(request)
            status = _recv_exact(sock, 1)
            value = _recv_blob(sock) if read_value and status == b"+" else b""
            return status == b"+", value
        except (OSError, ConnectionError) as exc:
            self._local.sock = None
            sock.close()
            raise ConnectionError(f"commsched store at {self.host}:{self.port}: {exc}") from exc

    def set(self, key: str, value: bytes) -> None:
        self._call(b"S" + _blob(key.encode()) + _blob(bytes(value)), 0.0)

    def get(self, key: str, timeout_s: float) -> bytes:
        found, value = self._call(b"G" + _blob(key.encode()) + _F64.pack(timeout_s), timeout_s, read_value=True)
        if not found:
            raise TimeoutError(f"key {key!r} not set within {timeout_s:g} s")
        return value

    def check(self, key: str) -> bool:
        return self._call(b"C" + _blob(key.encode()), 0.0)[0]

    def delete(self, key: str) -> None:
        self._call(b"D" + _blob(key.encode()), 0.0)

    def add(self, key: str, amount: int) -> int:
        sock = self._sock()
        try:
            sock.settimeout(_CONNECT_TIMEOUT_S)
            sock.sendall(b"A" + _blob(key.encode()) + _I64.pack(int(amount)))
            _recv_exact(sock, 1)
            return _I64.unpack(_recv_exact(sock, 8))[0]
        except (OSError, ConnectionError) as exc:
            self._local.sock = None
            sock.close()
            raise ConnectionError(f"commsched store at {self.host}:{self.port}: {exc}") from exc

    def push(self, queue: str, value: bytes) -> None:
        self._call(b"Q" + _blob(queue.encode()) + _blob(bytes(value)), 0.0)

    def pop(self, queue: str, timeout_s: float) -> bytes:
        found, value = self._call(b"P" + _blob(queue.encode()) + _F64.pack(timeout_s), timeout_s, read_value=True)
        if not found:
            raise TimeoutError(f"queue {queue!r} stayed empty for {timeout_s:g} s")
        return value

    def close(self) -> None:
        """Close every connection this client opened."""
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass

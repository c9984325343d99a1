"""One HTTP request bounded as a whole: connecting, sending, the headers and the body within `timeout` seconds.

urllib's `timeout` bounds each socket operation, not the request, so a server that trickles its reply a byte at a
time would hold a request forever. `draftsmith regenerate` (its --timeout) and vLLM capture in client mode
(`collect.vllm.timeout`) both fetch through `fetch_within`.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request


class _Deadline:
    """The end of one request's time: `expire` (a timer's) shuts the request's socket down, which ends any read in
    progress, so a server that trickles its reply a byte at a time cannot hold the request past its timeout (the
    socket timeout alone bounds each read, not the request)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.expired = self.done = False

    def attach(self, sock: socket.socket) -> socket.socket:
        """`sock`, the socket a connection (the first, or one a redirect opens) has just opened; TimeoutError when
        the deadline passed while it connected."""
        with self.lock:
            self.sock = sock
            expired = self.expired
        if expired:
            raise TimeoutError("the deadline passed while connecting")
        return sock

    def finish(self) -> bool:
        """Mark the reply read; whether it was read in time."""
        with self.lock:
            self.done = True
            return not self.expired

    def expire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.expired, sock = True, self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass


class _DeadlineHandler:
    """Mixed into urllib's HTTP(S) handlers: every connection they open reports its socket to the request's
    _Deadline."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        deadline = self.deadline

        def connection(host, **args):
            conn = http_class(host, **args)
            create, connect = getattr(conn, "_create_connection", None), conn.connect

            def create_and_attach(*a, **k):  # the TCP socket, before any proxy tunnel or TLS handshake on it
                return deadline.attach(create(*a, **k))

            def connect_and_attach():  # then the socket the request is sent on (TLS wraps the first in another)
                connect()
                deadline.attach(conn.sock)

            if create is not None:  # http.client's hook for opening the socket
                conn._create_connection = create_and_attach
            conn.connect = connect_and_attach
            return conn

        return super().do_open(connection, req, **kwargs)


class _DeadlineHTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


_DEADLINE_HANDLERS = [_DeadlineHTTPHandler]
if hasattr(urllib.request, "HTTPSHandler"):  # Python built with ssl
    class _DeadlineHTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
        pass

    _DEADLINE_HANDLERS.append(_DeadlineHTTPSHandler)


def fetch_within(request: urllib.request.Request, timeout: float, setting: str) -> bytes:
    """The body of `request`'s reply, the whole request (connecting, sending, the headers and the body, an error
    status's body too) within `timeout` seconds: past it, a TimeoutError naming the `setting` that sets it. An
    HTTPError carries (up to 2,000 bytes of) its body as `.body`."""
    deadline = _Deadline()
    opener = urllib.request.build_opener(*(handler(deadline) for handler in _DEADLINE_HANDLERS))
    timer = threading.Timer(timeout, deadline.expire)
    timer.daemon = True
    timer.start()
    late = f"no whole reply within {timeout:g} s ({setting})"
    try:
        try:
            with opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            e.body = e.read(2000)
            raise
        if deadline.finish():
            return raw
    except Exception:
        if not deadline.finish():  # whatever the cut-off read raised: cut short, reset, not JSON
            raise TimeoutError(late) from None
        raise
    finally:
        timer.cancel()
    raise TimeoutError(late)

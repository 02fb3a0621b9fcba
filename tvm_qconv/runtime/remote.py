"""Remote devices through TVM's own RPC: where one is, a session to it, a local cluster.

    Remote.parse(host="10.0.0.5", port=9090)        a server of its own (``deploy.py rpc --host``)
    Remote.parse(tracker="10.0.0.5:9190", key="h100")  any free server of a tracker with that key
    remote.connect()                                one ``tvm.rpc.RPCSession``; every failure is one
                                                    ``InputError`` line naming what to do
    with local_cluster(2) as remote: ...            a tracker and one server per local GPU, all on
                                                    127.0.0.1, stopped (by PID) at the end

The servers are TVM's (``tvm.rpc.Server``), started by ``python -m tvm_qconv.cli.rpc_server``, which
only adds the project's runtime functions (the wgmma kernels' TMA encoder) and binds 127.0.0.1
unless told otherwise: **TVM RPC has no authentication**: whoever reaches a server can upload and
run any code on it.  Reach a remote GPU through an ssh tunnel (``ssh -L 9190:127.0.0.1:9190``),
never by binding a public address on an untrusted network.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import InputError

# tvm (~2 s to import, torch with it) is imported where a session is opened or a GPU counted:
# `python -m tvm_qconv.cli.rpc_server` imports this module before it parses its arguments.
LOOPBACK = "127.0.0.1"
LOCAL_KEY = "tvm_qconv-local"  # the key of the servers local_cluster starts
CONNECT_TIMEOUT_S = 10.0       # to reach a host at all (TCP), before any RPC
SERVER_START_TIMEOUT_S = 90.0  # local_cluster: until every server is registered with the tracker

SERVER_HOW = "start one on the GPU machine with `python -m tvm_qconv.cli.rpc_server` (docs/usage.md#remote-gpus-tvm-rpc)"


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{what} {text!r} is not HOST:PORT (e.g. 127.0.0.1:9190)")
    return host, int(port)


def _probe(host: str, port: int, what: str, how: str) -> None:
    """Fail fast, in one line, when nothing listens at host:port (TVM's tracker client retries
    for a minute, and its socket errors are internal-error backtraces)."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except socket.gaierror as err:
        raise InputError(f"unknown host {host!r} for the {what}: {err.strerror}") from None
    except ConnectionRefusedError:
        raise InputError(f"connection refused by {host}:{port}: no {what} is listening there; {how}") from None
    except (TimeoutError, socket.timeout):
        raise InputError(f"no answer from {host}:{port} within {CONNECT_TIMEOUT_S:.0f} s (the {what}): check the "
                         f"address, the firewall or the ssh tunnel; {how}") from None
    except OSError as err:
        raise InputError(f"cannot reach the {what} at {host}:{port}: {err.strerror or err}; {how}") from None


@dataclass(frozen=True)
class Remote:
    """Where the remote device is: a server of its own (``host``, ``port``), or the servers a
    tracker (``tracker_host``, ``tracker_port``) knows under ``key``.

    Attributes:
        timeout_s: how long to wait for a free server of a tracker, and the session's limit
            for one call (a run that hangs longer is cut, with a message).
    """

    host: str | None = None
    port: int | None = None
    tracker_host: str | None = None
    tracker_port: int | None = None
    key: str | None = None
    timeout_s: float = 60.0

    @classmethod
    def parse(cls, host: str | None = None, port: int | None = None, tracker: str | None = None,
              key: str | None = None, timeout_s: float = 60.0) -> "Remote":
        """From the CLI's flags: ``--host H --port P``, or ``--tracker H:P --key K``.

        Raises:
            InputError: neither or both forms, a malformed address, a missing key.
        """
        if tracker and (host or port):
            raise InputError("give either --host/--port (one server) or --tracker/--key (a tracker's servers), "
                             "not both")
        if tracker:
            th, tp = _host_port(tracker, "--tracker")
            if not key:
                raise InputError(f"--tracker {tracker} needs --key: the key its GPU servers registered with "
                                 f"(python -m tvm.exec.query_rpc_tracker --host {th} --port {tp} lists them)")
            return cls(tracker_host=th, tracker_port=tp, key=key, timeout_s=timeout_s)
        if not host or port is None:
            raise InputError("say where the remote device is: --host H --port P (a server), or --tracker H:P "
                             "--key K (a tracker)")
        if not 0 < port < 65536:
            raise InputError(f"--port {port} is not a TCP port (1-65535)")
        return cls(host=host, port=port, timeout_s=timeout_s)

    @property
    def via_tracker(self) -> bool:
        return self.tracker_host is not None

    def describe(self) -> str:
        if self.via_tracker:
            return f"tracker {self.tracker_host}:{self.tracker_port}, key {self.key}"
        return f"server {self.host}:{self.port}"

    def servers(self) -> tuple[int, int]:
        """(registered, free) servers of the tracker under ``key``.

        Raises:
            InputError: the tracker cannot be reached.
        """
        tracker = self._tracker()
        summary = tracker.summary()
        registered = sum(1 for s in summary.get("server_info", []) if s["key"].split(":", 1)[-1] == self.key)
        free = summary.get("queue_info", {}).get(self.key, {}).get("free", 0)
        return registered, free

    def _tracker(self):
        from tvm import rpc  # see the note at LOOPBACK
        _probe(self.tracker_host, self.tracker_port, "RPC tracker",
               f"start it with `python -m tvm.exec.rpc_tracker --host 127.0.0.1 --port {self.tracker_port}`")
        return rpc.connect_tracker(self.tracker_host, self.tracker_port)

    def connect(self, session_timeout: float | None = None):
        """One RPC session (``tvm.rpc.RPCSession``) to the remote device.

        Args:
            session_timeout: seconds after which the server ends the session (0: never);
                default ``timeout_s``.
        Raises:
            InputError: nothing listens there, the tracker has no server with the key, every
                such server stayed busy for ``timeout_s``, or the server refused the session.
        """
        from tvm import rpc  # see the note at LOOPBACK
        limit = self.timeout_s if session_timeout is None else session_timeout
        if not self.via_tracker:
            _probe(self.host, self.port, "RPC server", SERVER_HOW)
            try:
                return rpc.connect(self.host, self.port, session_timeout=limit)
            except Exception as err:  # TVM raises InternalError with a backtrace
                raise InputError(f"the RPC server at {self.host}:{self.port} refused the session "
                                 f"({str(err).strip().splitlines()[-1][:200]}): a server registered with a tracker "
                                 f"takes sessions only through it (use --tracker H:P --key K)") from None
        tracker = self._tracker()
        summary = tracker.summary()
        keys = sorted({s["key"].split(":", 1)[-1] for s in summary.get("server_info", [])})
        if self.key not in keys:
            raise InputError(f"no RPC server with key {self.key!r} is registered at tracker {self.tracker_host}:"
                             f"{self.tracker_port} (keys there: {', '.join(keys) or 'none'}): {SERVER_HOW} "
                             f"--tracker {self.tracker_host}:{self.tracker_port} --key {self.key}")
        got: dict = {}

        def request():
            try:
                got["session"] = tracker.request(self.key, priority=1, session_timeout=limit, max_retry=1)
            except Exception as err:  # noqa: BLE001 (reported below in one line)
                got["error"] = err
        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise InputError(f"every RPC server with key {self.key!r} at tracker {self.tracker_host}:"
                             f"{self.tracker_port} stayed busy for {self.timeout_s:.0f} s: wait for their sessions "
                             f"to end, or start more servers") from None
        if "error" in got:
            raise InputError(f"tracker {self.tracker_host}:{self.tracker_port} gave no session for key {self.key!r} "
                             f"({str(got['error']).strip().splitlines()[-1][:200]}): check that its servers are "
                             f"alive (python -m tvm.exec.query_rpc_tracker)") from None
        return got["session"]


def remote_gpu(session) -> tuple[object, str, str]:
    """(device, arch ``sm_XY``, name) of GPU 0 of an RPC session.

    Raises:
        InputError: the remote machine has no CUDA GPU.
    """
    dev = session.cuda(0)
    if not dev.exist:
        raise InputError("the remote machine has no CUDA GPU (or its TVM was built without CUDA)")
    try:
        return dev, f"sm_{dev.compute_version.replace('.', '')}", dev.device_name
    except Exception as err:  # noqa: BLE001 (an RPCError from the server's CUDA runtime)
        raise InputError(f"the remote GPU failed its first CUDA call ({str(err).strip().splitlines()[-1][:160]}): "
                         f"a server forked after CUDA was initialized; start it with `python -m "
                         f"tvm_qconv.cli.rpc_server`, or set TVM_FFI_DISABLE_TORCH_C_DLPACK=1 for tvm.exec.rpc_server") \
            from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM then SIGKILL each process's group (the servers fork a child per session)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.time() + 5
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def local_cluster(num_servers: int, gpus: bool = True, key: str = LOCAL_KEY, log_dir: str | None = None):
    """A tracker and ``num_servers`` RPC servers on this machine, bound to 127.0.0.1; yields the
    :class:`Remote` of the tracker.  With ``gpus``, server ``i`` sees only GPU ``i``
    (``CUDA_VISIBLE_DEVICES``), so N servers measure N candidates at once.  Every process is
    stopped on exit, also on an exception or Ctrl-C.

    Raises:
        InputError: ``num_servers`` < 1, more servers than GPUs, or a server that did not come up.
    """
    if num_servers < 1:
        raise InputError(f"--local-gpus must be >= 1, got {num_servers}")
    if gpus:
        from ..target import device_arch  # tvm: see the note at LOOPBACK
        have = sum(1 for i in range(num_servers) if device_arch(i) is not None)
        if have < num_servers:
            raise InputError(f"--local-gpus {num_servers}, but this machine has {have} CUDA GPU(s): use at most "
                             f"{have}, or --rpc-tracker for GPUs on other machines")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        tracker_port = _free_port()
        tracker_log = open(os.path.join(log_dir, "rpc_tracker.log") if log_dir else os.devnull, "w")
        logs.append(tracker_log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", LOOPBACK, "--port", str(tracker_port),
             "--port-end", str(tracker_port + 1), "--silent"],
            stdout=tracker_log, stderr=subprocess.STDOUT, start_new_session=True))
        remote = Remote(tracker_host=LOOPBACK, tracker_port=tracker_port, key=key)
        deadline = time.time() + SERVER_START_TIMEOUT_S
        while True:  # the tracker first: a server that finds none retries only every 5 s
            try:
                socket.create_connection((LOOPBACK, tracker_port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or procs[0].poll() is not None:
                    raise InputError("the local RPC tracker did not start (python -m tvm.exec.rpc_tracker)") from None
                time.sleep(0.2)
        for i in range(num_servers):
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            log = open(os.path.join(log_dir, f"rpc_server{i}.log") if log_dir else os.devnull, "w")
            logs.append(log)
            port = _free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tvm_qconv.cli.rpc_server", "--host", LOOPBACK, "--port", str(port),
                 "--port-end", str(port + 50), "--tracker", f"{LOOPBACK}:{tracker_port}", "--key", key, "--silent"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        while remote.servers()[0] < num_servers:
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.time() > deadline:
                raise InputError(f"{num_servers} local RPC server(s) did not all register with the tracker within "
                                 f"{SERVER_START_TIMEOUT_S:.0f} s" + (f" (logs in {log_dir})" if log_dir else ""))
            time.sleep(0.2)
        yield remote
    finally:
        _stop(procs)
        for log in logs:
            log.close()

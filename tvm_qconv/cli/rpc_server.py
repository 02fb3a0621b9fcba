"""python -m tvm_qconv.cli.rpc_server: TVM's RPC server for the machine with the GPU.

    python -m tvm_qconv.cli.rpc_server                                   one server, 127.0.0.1:9090
    python -m tvm_qconv.cli.rpc_server --tracker 127.0.0.1:9190 --key h100   registered with a tracker

It is ``tvm.rpc.Server`` (what ``python -m tvm.exec.rpc_server`` starts) with three differences:
it registers the project's runtime functions in the server (``schedules/runtime_functions.py``: the
TMA encoder that libraries of Hopper's kernels call), it binds 127.0.0.1 unless ``--host``
says otherwise, and its forked sessions can use CUDA where torch is installed beside TVM (below).  TVM RPC has no authentication: anyone who reaches the port can run any code on
this machine.  From another machine, tunnel to it (``ssh -L 9090:127.0.0.1:9090 gpu-host``)
instead of binding a public address.
"""
from __future__ import annotations

import argparse
import os
import sys

# The server forks a process per session.  With torch installed, tvm_ffi's torch DLPack extension
# initializes CUDA in the parent when tvm is imported, and every forked session then fails its
# first CUDA call (cudaErrorInitializationError: measured on an H200 host, 2026-11-24, with
# tvm.exec.rpc_server too).  The extension only speeds up torch <-> TVM tensor exchange, which a
# server never does; set before anything imports tvm (the popen worker inherits it).
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

from .. import cli
from ..errors import InputError
from ..runtime.remote import LOOPBACK, _host_port


def register_runtime() -> None:
    """Runs in the server process before it serves (``server_init_callback``); sessions are
    forked from it and inherit the registrations."""
    # `python -m` runs this module as __main__, so the callback reaches the server's process by value
    # (cloudpickle): what it imports itself is all that runs there
    from ..schedules import runtime_functions  # in the body: the server's process receives it by value (above)
    runtime_functions.register()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]) if sys.argv[0].endswith("tvm-qconv-rpc-server")
                                else "python -m tvm_qconv.cli.rpc_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=LOOPBACK,
                   help="address to bind (default 127.0.0.1: reach it through an ssh tunnel; a public address "
                        "lets anyone on the network run code here)")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--port-end", type=int, default=None, help="last port to try (default --port + 100)")
    p.add_argument("--tracker", default=None, metavar="HOST:PORT",
                   help="register with this RPC tracker (then sessions come only through it)")
    p.add_argument("--key", default="", help="the key to register under (needed with --tracker), e.g. h100")
    p.add_argument("--silent", action="store_true", help="log nothing")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tvm import rpc  # after parsing: --help and a bad flag answer without tvm's ~2 s

    def serve() -> int:
        tracker = None
        if args.tracker:
            if not args.key:
                raise InputError("--tracker needs --key: the key clients will ask the tracker for (e.g. h100)")
            tracker = _host_port(args.tracker, "--tracker")
        port_end = args.port + 100 if args.port_end is None else args.port_end
        if not 0 < args.port <= port_end < 65536:
            raise InputError(f"--port {args.port} --port-end {port_end}: need 0 < port <= port-end < 65536")
        try:
            server = rpc.Server(args.host, args.port, port_end + 1, tracker_addr=tracker, key=args.key,
                                silent=args.silent, server_init_callback=register_runtime)
        except ValueError as err:  # tvm.rpc.Server: "cannot bind to any port in [...)"
            raise InputError(f"{err} on {args.host}: another server runs there, or the address is not this "
                             f"machine's; pick other ports with --port/--port-end") from None
        if not args.silent:
            where = f", registered with tracker {args.tracker} as {args.key!r}" if tracker else ""
            print(f"[rpc_server] TVM RPC server on {args.host}:{server.port}{where}; Ctrl-C stops it", flush=True)
        server.proc.join()
        return 0
    return cli.run(serve, "the server stopped")


if __name__ == "__main__":
    sys.exit(main())

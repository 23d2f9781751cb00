"""`python -m vllm_localcluster.emulator`: a standalone emulated API server for the demo,
e2e scripts and manual kubectl sessions."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from vllm_localcluster.emulator.server import EmulatorServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_localcluster.emulator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for the server here")
    parser.add_argument("--crds", help="a CRD YAML file or a directory of them")
    parser.add_argument(
        "--no-auto-namespaces",
        action="store_true",
        help="require namespaces to exist, as a real cluster does",
    )
    parser.add_argument("--bookmark-interval", type=float, default=5.0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


async def _serve(args: argparse.Namespace) -> None:
    server = EmulatorServer(
        args.host,
        args.port,
        crds=args.crds,
        auto_create_namespaces=not args.no_auto_namespaces,
        bookmark_interval=args.bookmark_interval,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        if args.kubeconfig:
            server.write_kubeconfig(args.kubeconfig)
        print(server.url, flush=True)
        await stop.wait()
    print("emulator stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

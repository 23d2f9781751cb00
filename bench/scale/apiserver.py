"""The API emulator in its own process, with its request log reachable over a pipe.

At a thousand deployments the emulator is as busy as the operator (watches, lists, status
patches); sharing a process, and so a GIL, with the benchmark's Prometheus stand-in and kubelet
would slow all three and show up as operator latency. A child process gets its own core.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

READS = frozenset({"get", "list", "watch"})


@dataclass(frozen=True)
class Write:
    verb: str
    resource: str
    user_agent: str


def _serve(conn: Connection, crds: str) -> None:
    from vllm_localcluster.emulator import EmulatorServer

    server = EmulatorServer(crds=crds, max_requests_kept=500_000).start_in_thread()
    conn.send(server.url)
    while True:
        command = conn.recv()
        if command == "clear":
            server.emulator.clear_requests()
            conn.send(None)
        elif command == "writes":
            conn.send(
                [
                    (
                        r.verb,
                        f"{r.resource}{'/' + r.subresource if r.subresource else ''}",
                        r.user_agent or "",
                    )
                    for r in server.emulator.requests
                    if r.verb not in READS
                ]
            )
        else:
            server.stop()
            conn.send(None)
            return


class ApiServer:
    def __init__(self, conn: Connection, url: str) -> None:
        self._conn = conn
        self.url = url

    def _ask(self, command: str) -> Any:
        self._conn.send(command)
        return self._conn.recv()

    def clear_requests(self) -> None:
        self._ask("clear")

    def writes(self) -> list[Write]:
        return [Write(*w) for w in self._ask("writes")]

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: e, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: e, user: {token: emulator}}]\n"
            "contexts: [{name: e, context: {cluster: e, user: e}}]\n"
            "current-context: e\n"
        )
        return path


@contextmanager
def api_server(crds: Path, timeout_s: float = 30.0) -> Iterator[ApiServer]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(child, str(crds)), name="api-emulator")
    process.start()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError("the API emulator process did not start")
        yield ApiServer(parent, parent.recv())
    finally:
        try:
            parent.send("stop")
            parent.poll(10)
        except (BrokenPipeError, OSError):
            pass
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)

"""A replica autoscaler for the one-machine cluster: it writes replica counts the way the HPA
controller does, through the target's scale subresource.

The HPA controller reads the target's `/scale` (an autoscaling/v1 Scale), sets `spec.replicas`
and writes the Scale back with an update (kubernetes pkg/controller/podautoscaler). This one
does the same, under its own field manager and user agent, from a schedule instead of metrics:
the e2e scenarios and the soak need a count that moves every few minutes while the operator
tunes, and a record of every write to compare with what the operator wrote.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIELD_MANAGER = "vllm-localcluster-autoscaler"
USER_AGENT = "vllm-localcluster/autoscaler"


class ScaleError(RuntimeError):
    pass


@dataclass(frozen=True)
class ScaleWrite:
    """One write: the wall time it was answered, the count before and after."""

    time: float
    before: int
    after: int


class ScheduledScaler:
    """Writes `schedule[i % len(schedule)]` to `scale_path` (an object's /scale) every
    `period_s` wall seconds, first after one period, until stopped."""

    def __init__(
        self,
        server: str,
        token: str,
        ca_file: str,
        scale_path: str,
        schedule: Sequence[int],
        period_s: float,
        *,
        field_manager: str = FIELD_MANAGER,
    ) -> None:
        if not schedule or any(n < 0 for n in schedule) or period_s <= 0:
            raise ValueError("a schedule of counts >= 0 and a period > 0 are needed")
        self.server = server.rstrip("/")
        self.token = token
        self.context = ssl.create_default_context(cafile=ca_file)
        self.scale_path = scale_path
        self.schedule = list(schedule)
        self.period_s = period_s
        self.field_manager = field_manager
        self.writes: list[ScaleWrite] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _call(self, method: str, body: Any = None) -> dict[str, Any]:
        url = f"{self.server}{self.scale_path}"
        if method == "PUT":
            url += f"?fieldManager={self.field_manager}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        request.add_header("User-Agent", USER_AGENT)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as error:
            raise ScaleError(f"{method} {self.scale_path}: {error.code} {error.read()!r}") from None

    def scale_to(self, replicas: int) -> ScaleWrite:
        """GET the Scale, set spec.replicas, PUT it back (a conflict means someone wrote in
        between: read again, as the HPA controller's next sync would)."""
        for _ in range(3):
            scale = self._call("GET")
            before = int((scale.get("spec") or {}).get("replicas", 0))
            scale["spec"] = {**(scale.get("spec") or {}), "replicas": replicas}
            try:
                self._call("PUT", scale)
            except ScaleError as exc:
                if " 409 " in str(exc):
                    continue
                raise
            write = ScaleWrite(time.time(), before, replicas)
            self.writes.append(write)
            return write
        raise ScaleError(f"{self.scale_path}: three conflicts in a row")

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self.period_s):
            try:
                self.scale_to(self.schedule[i % len(self.schedule)])
            except (ScaleError, OSError) as exc:
                self.errors.append(str(exc))
            i += 1

    def start(self) -> ScheduledScaler:
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
            self._thread = None

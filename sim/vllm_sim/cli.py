"""`vllm-sim`: serve a simulated vLLM, load a server, or run a workload in virtual time.

    vllm-sim serve MODEL [vLLM flags] [--sim-* flags]     OpenAI API + /metrics, like `vllm serve`
    vllm-sim run MODEL [vLLM flags] --workload chat --rate 5 --duration 600
                                                          virtual time, as fast as the CPU allows
    vllm-sim load --url http://127.0.0.1:8000 --workload chat --rate 5 --duration 60
                                                          streaming HTTP client, any vLLM server
    vllm-sim models | gpus                                the catalog

`--workload` takes a preset (chat, rag, code, reasoning) or a YAML/JSON file in the format of
`vllm_sim.workload`; flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_sim import VLLM_VERSION, __version__
from vllm_sim.types import StartupError
from vllm_sim.workload import PRESETS, Slo, WorkloadSpec, run_virtual, summarize

USAGE = __doc__ or ""


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        default="chat",
        help=f"preset ({', '.join(PRESETS)}) or a YAML/JSON workload file (default: chat)",
    )
    group.add_argument("--rate", type=float, default=None, help="requests per second")
    group.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    group.add_argument("--seed", type=int, default=None, help="workload seed")
    group.add_argument("--burstiness", type=float, default=None, help="1 = Poisson, <1 burstier")
    group.add_argument("--prefix-ratio", type=float, default=None, help="shared system prompt")
    group.add_argument("--prefix-groups", type=int, default=None)
    group.add_argument("--max-requests", type=int, default=None)
    slo = parser.add_argument_group("SLO for goodput (milliseconds)")
    for name in ("ttft", "itl", "tpot", "e2e"):
        slo.add_argument(f"--slo-{name}-ms", type=float, default=None)
    parser.add_argument("--json", dest="json_out", default=None, help="write results as JSON")


def workload_from_args(ns: argparse.Namespace) -> WorkloadSpec:
    spec: dict[str, Any]
    if ns.workload in PRESETS:
        spec = {"preset": ns.workload}
    else:
        path = Path(ns.workload)
        if not path.is_file():
            raise SystemExit(
                f"error: --workload {ns.workload!r} is neither a preset "
                f"({', '.join(PRESETS)}) nor a file"
            )
        text = path.read_text()
        if path.suffix == ".json":
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text) or {}
        if not isinstance(spec, dict):
            raise SystemExit(f"error: {path} does not hold a mapping")
        nested = spec.get("workload")
        if isinstance(nested, dict):  # a scenario file with a `workload:` section
            spec = dict(nested)
    overrides = {
        "rate": ns.rate,
        "duration": ns.duration,
        "seed": ns.seed,
        "burstiness": ns.burstiness,
        "max_requests": ns.max_requests,
    }
    spec.update({k: v for k, v in overrides.items() if v is not None})
    if ns.prefix_ratio is not None or ns.prefix_groups is not None:
        prefix = dict(spec.get("prefix") or {})
        if ns.prefix_ratio is not None:
            prefix["ratio"] = ns.prefix_ratio
        if ns.prefix_groups is not None:
            prefix["groups"] = ns.prefix_groups
        spec["prefix"] = prefix
    try:
        return WorkloadSpec.from_dict(spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: bad workload: {exc}") from None


def slo_from_args(ns: argparse.Namespace) -> Slo | None:
    values = {k: getattr(ns, f"slo_{k}_ms") for k in ("ttft", "itl", "tpot", "e2e")}
    if all(v is None for v in values.values()):
        return None
    return Slo(**{k: None if v is None else v / 1000.0 for k, v in values.items()})


def _progress_printer(label: str) -> Callable[[float, int, int], None]:
    last = [time.monotonic()]

    def report(t: float, finished: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            print(f"{label} t={t:.0f}s finished {finished}/{total}", file=sys.stderr, flush=True)

    return report


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def _clean_nans(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean_nans(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_nans(v) for v in value]
    return value


def cmd_serve(argv: Sequence[str]) -> int:
    from vllm_sim import server
    from vllm_sim.flags import parse_serve_args

    return server.main(parse_serve_args(argv))


def cmd_run(argv: Sequence[str]) -> int:
    from vllm_sim import server
    from vllm_sim.flags import (
        add_engine_arguments,
        engine_config_from,
        ignored_flags,
        reality_from,
        warn_ignored,
    )

    parser = argparse.ArgumentParser(
        prog="vllm-sim run",
        description="Run a workload through the simulated engine in virtual time.",
    )
    add_engine_arguments(parser, os.environ, keep=("--seed",))
    add_workload_arguments(parser)
    ns, unknown = parser.parse_known_args(list(argv))
    warn_ignored(ignored_flags(ns, unknown))
    config, reality = engine_config_from(ns), reality_from(ns)
    workload = workload_from_args(ns)
    try:
        engine = server.default_engine_factory(config, reality, ns.sim_seed, record_itl=True)
    except (StartupError, ValueError) as exc:
        print(f"error: the engine cannot start: {exc}", file=sys.stderr)
        return 1
    requests = workload.generate()
    started = time.monotonic()
    records = run_virtual(
        engine,
        requests,
        progress=_progress_printer("virtual"),
        progress_every=max(workload.duration / 50.0, 1.0),
    )
    wall = time.monotonic() - started
    summary = summarize(records, slo=slo_from_args(ns), submitted=len(requests))
    resolved = engine.resolved
    print(
        f"{config.model} on {config.gpu} x{config.tensor_parallel_size}: "
        f"max_num_seqs={resolved.max_num_seqs} "
        f"max_num_batched_tokens={resolved.max_num_batched_tokens} "
        f"gpu_memory_utilization={resolved.gpu_memory_utilization}"
    )
    print(f"workload {workload.name}: {len(requests)} requests over {workload.duration:.0f}s")
    print(summary.table())
    print(f"simulated {summary.duration:.0f} virtual seconds in {wall:.1f} wall seconds")
    _write_json(
        ns.json_out,
        _clean_nans({"summary": summary.as_dict(), "wall_seconds": wall, "config": str(resolved)}),
    )
    return 0


def cmd_load(argv: Sequence[str]) -> int:
    from vllm_sim.loadgen import run_http

    parser = argparse.ArgumentParser(
        prog="vllm-sim load",
        description="Send a workload to a vLLM-compatible server and measure it client-side.",
    )
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the server's --sim-time-scale: arrivals are sent at virtual/scale wall seconds",
    )
    parser.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    parser.add_argument(
        "--timeout", type=float, default=None, help="wall seconds before open requests are cut"
    )
    add_workload_arguments(parser)
    ns = parser.parse_args(list(argv))
    workload = workload_from_args(ns)
    result = asyncio.run(
        run_http(
            ns.url,
            workload,
            time_scale=ns.time_scale,
            concurrency=ns.concurrency,
            timeout=ns.timeout,
            model=ns.model,
            slo=slo_from_args(ns),
            progress=_progress_printer("wall"),
        )
    )
    errors = [r for r in result.records if r.error]
    print(result.summary.table())
    if errors:
        print(f"{len(errors)} requests failed, e.g. {errors[0].error}")
    _write_json(ns.json_out, _clean_nans(result.as_dict()))
    return 0 if not errors else 2


def cmd_models() -> int:
    from vllm_sim import catalog

    for name in catalog.model_names():
        spec = catalog.load_model(name)
        print(f"{name:<45} max_model_len={spec.max_position_embeddings}")
    return 0


def cmd_gpus() -> int:
    from vllm_sim import catalog

    for name in catalog.gpu_names():
        gpu = catalog.load_gpu(name)
        print(f"{name:<12} {gpu.memory_gib:7.1f} GiB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("--version", "version"):
        print(f"vllm-sim {__version__} (simulates vLLM {VLLM_VERSION})")
        return 0
    if command == "serve":
        return cmd_serve(rest)
    if command == "run":
        return cmd_run(rest)
    if command == "load":
        return cmd_load(rest)
    if command == "models":
        return cmd_models()
    if command == "gpus":
        return cmd_gpus()
    print(f"vllm-sim: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""`vllm-autotuner`: run the operator, print the CRDs, recommend flags.

The one-machine demo lives in its own package: `vllm-localcluster demo` (`make demo`)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_autotuner import __version__


def parse_duration(text: str) -> float:
    """Seconds in a Go duration (`30s`, `1m30s`, `1.5h`), by the parser the CRDs use; the
    chart's values schema accepts the same language, so a valid install never exits here."""
    from vllm_autotuner.api.durations import duration_seconds

    try:
        return duration_seconds(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (Go syntax, e.g. 30s, 1m30s, 1h)"
        ) from exc


def peering_priority(pod_name: str | None) -> int:
    """A stable, distinct-per-pod priority: kopf pauses every peer when priorities are equal."""
    seed = pod_name or f"{os.uname().nodename}-{os.getpid()}"
    return 1 + int(hashlib.sha256(seed.encode()).hexdigest()[:7], 16)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text:
            return text
        return super()._get_help_string(action) or text


def _bounded(
    kind: type[float] | type[int], low: float, high: float | None = None, *, open_low: bool
) -> Any:
    """An argparse type: a number in (low, high] (open_low) or [low, high]."""
    span = f"{'(' if open_low else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        below = value <= low if open_low else value < low
        if below or (high is not None and value > high) or value != value:
            raise argparse.ArgumentTypeError(f"{text} is out of range {span}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE = _bounded(float, 0.0, open_low=True)
COUNT = _bounded(int, 1, open_low=False)
NON_NEGATIVE_COUNT = _bounded(int, 0, open_low=False)
PORT = _bounded(int, 0, 65535, open_low=False)
FRACTION = _bounded(float, 0.0, 1.0, open_low=True)
PERCENTILE = _bounded(float, 0.0, 99.99, open_low=True)


def gpu_product(text: str) -> str:
    """A GPU product vLLM's per-GPU defaults (and the model) know; anything else is refused."""
    from vllm_autotuner.core.knob_defaults import GPU_MEMORY_GIB, gpu_memory_gib

    if gpu_memory_gib(text) is None:
        raise argparse.ArgumentTypeError(
            f"unknown GPU {text!r}; known: {', '.join(sorted(GPU_MEMORY_GIB))}"
        )
    return text


def _subparser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=summary, formatter_class=_Help)


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _subparser(sub, "run", "run the operator against the cluster (production entry point)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true",
        help="watch every namespace (what happens without --namespace)",
    )  # fmt: skip
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch only this namespace (repeat)"
    )
    p.add_argument(
        "--kubeconfig",
        help="kubeconfig file (without it: the pod's service account, else $KUBECONFIG, "
        "else ~/.kube/config)",
    )
    p.add_argument(
        "--prometheus-url",
        help="Prometheus base URL, e.g. http://prometheus:9090 (without it nothing is tuned)",
    )
    p.add_argument(
        "--prometheus-timeout", type=parse_duration, default="10s", help="timeout of one query"
    )
    p.add_argument("--prometheus-bearer-token-file", help="file with a bearer token for Prometheus")
    p.add_argument("--prometheus-ca-file", help="CA bundle for a TLS Prometheus")
    p.add_argument(
        "--prometheus-rate-scale",
        type=POSITIVE,
        default=1.0,
        help=argparse.SUPPRESS,  # simulated fleets only: vllm-sim's --sim-time-scale
    )
    p.add_argument(
        "--prometheus-min-window",
        type=parse_duration,
        default="60s",
        help="shortest window of a new revision worth judging (at least two scrapes)",
    )
    p.add_argument(
        "--performance-model",
        choices=["analytic", "engine"],
        default="analytic",
        help="the tuner's model: closed-form (fast) or vllm-sim's engine (slower, finer)",
    )
    p.add_argument(
        "--reconcile-interval",
        type=parse_duration,
        default="30s",
        help="how often each VLLMDeployment is reconciled (and Prometheus read)",
    )
    p.add_argument(
        "--request-timeout",
        type=parse_duration,
        default="30s",
        help="timeout of one Kubernetes API call",
    )
    p.add_argument("--liveness-port", type=PORT, default=8080, help="serves /healthz; 0 disables")
    p.add_argument("--metrics-port", type=PORT, default=9090, help="serves /metrics; 0 disables")
    p.add_argument(
        "--log-format",
        choices=["plain", "full", "json"],
        default="plain",
        help="plain: messages; full: with time, logger and level; json: one object per line",
    )
    p.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering NAME, for a warm standby (without it: one operator, no peering)",
    )
    p.add_argument(
        "--verbose", "-v", action="store_true", help="debug logs, kopf's per-handler lines too"
    )


def _add_crds(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _subparser(sub, "crds", "print the CustomResourceDefinitions (or write them to --out)")
    p.add_argument("--out", type=Path, help="directory to write one file per CRD")


def _add_recommend(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _subparser(
        sub,
        "recommend",
        "print the diagnosis and recommended vLLM flags for a fleet, from Prometheus alone",
    )
    p.add_argument(
        "--prometheus",
        "--prometheus-url",
        dest="prometheus",
        required=True,
        help="Prometheus base URL, e.g. http://prometheus:9090",
    )
    p.add_argument("--namespace", "-n", help="only pods in this namespace")
    p.add_argument("--pod-regex", help="only pods whose name matches this regex")
    p.add_argument(
        "--selector", "-l", action="append", default=[], metavar="LABEL=VALUE",
        help="only series with this Prometheus label value (repeat)",
    )  # fmt: skip
    p.add_argument("--ttft-ms", type=POSITIVE, help="TTFT SLO threshold (ms)")
    p.add_argument(
        "--ttft-percentile", type=PERCENTILE, default=95.0, help="percentile the TTFT SLO is on"
    )
    p.add_argument("--itl-ms", type=POSITIVE, help="inter-token latency SLO threshold (ms)")
    p.add_argument(
        "--itl-percentile", type=PERCENTILE, default=95.0, help="percentile the ITL SLO is on"
    )
    p.add_argument("--e2e-ms", type=POSITIVE, help="optional end-to-end p95 SLO (ms)")
    p.add_argument("--policy", type=Path, help="a VLLMTuningPolicy YAML instead of the SLO flags")
    p.add_argument(
        "--gpu",
        type=gpu_product,
        required=True,
        help="GPU product of the fleet (H100, H200, A100-80GB, L40S, ...): the model and "
        "vLLM's default knobs depend on it",
    )
    p.add_argument("--model", help="model name, when Prometheus' model_name label is not it")
    p.add_argument("--tensor-parallel-size", type=COUNT, default=1, help="GPUs per vLLM server")
    current = "the fleet's current value (without it: vLLM's default on --gpu, a guess)"
    p.add_argument("--max-num-batched-tokens", type=COUNT, help=current)
    p.add_argument("--max-num-seqs", type=COUNT, help=current)
    p.add_argument("--gpu-memory-utilization", type=FRACTION, help=current)
    p.add_argument(
        "--window", type=parse_duration, default="5m", help="how far back to read Prometheus"
    )
    p.add_argument(
        "--min-requests",
        type=NON_NEGATIVE_COUNT,
        default=100,
        help="fewest requests in the window worth judging",
    )
    p.add_argument(
        "--timeout", type=parse_duration, default="10s", help="timeout of one Prometheus query"
    )
    p.add_argument("--bearer-token-file", help="file with a bearer token for Prometheus")
    p.add_argument("--ca-file", help="CA bundle for a TLS Prometheus")
    p.add_argument("--rate-scale", type=POSITIVE, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _missing_extra(module: str, extra: str, command: str) -> bool:
    """True (and one line on stderr) when an optional dependency of `command` is absent."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return False
    print(
        f"error: vllm-autotuner {command} needs {module}, which the operator image does not "
        f"carry: pip install 'vllm-autotuner[{extra}]'",
        file=sys.stderr,
    )
    return True


def cmd_recommend(args: argparse.Namespace) -> int:
    if _missing_extra("prometheus_api_client", "recommend", "recommend"):
        return 2
    from vllm_autotuner.recommend import (
        PrometheusError,
        RecommendRequest,
        print_advice,
        recommend,
    )

    if args.policy is None and (args.ttft_ms is None or args.itl_ms is None):
        print("error: give --ttft-ms and --itl-ms, or --policy FILE", file=sys.stderr)
        return 2
    labels = {}
    for item in args.selector:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"error: --selector wants LABEL=VALUE, got {item!r}", file=sys.stderr)
            return 2
        labels[key] = value
    request = RecommendRequest(
        prometheus_url=args.prometheus,
        ttft_ms=args.ttft_ms or 0.0,
        itl_ms=args.itl_ms or 0.0,
        ttft_percentile=args.ttft_percentile,
        itl_percentile=args.itl_percentile,
        e2e_ms=args.e2e_ms,
        namespace=args.namespace,
        pod_regex=args.pod_regex,
        labels=labels or None,
        gpu=args.gpu,
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        window_s=args.window,
        min_requests=args.min_requests,
        policy_file=args.policy,
        timeout_s=args.timeout,
        bearer_token_file=args.bearer_token_file,
        ca_file=args.ca_file,
        rate_scale=args.rate_scale,
    )
    try:
        advice = recommend(request)
    except PrometheusError as exc:
        print(f"error: cannot query Prometheus at {args.prometheus}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_advice(advice, sys.stdout, as_json=args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-autotuner",
        description="Deploys vLLM on Kubernetes and tunes its batching and KV-cache knobs "
        "against SLOs.",
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_crds(sub)
    _add_recommend(sub)
    _add_requests(sub)
    return parser


REQUESTS = {
    "pause": "pause tuning of a VLLMDeployment: nothing new is rolled out until resume",
    "resume": "resume tuning that pause paused",
    "promote": "promote the running canary now, without waiting for its verdict",
    "abort": "abort the running canary and keep the configuration before it",
    "retry": "let the tuner try again the configuration it blocked last",
}


def _add_requests(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for command, summary in REQUESTS.items():
        p = _subparser(sub, command, summary)
        p.add_argument("name", help="the VLLMDeployment")
        p.add_argument(
            "--namespace", "-n", help="its namespace (without it: the kubeconfig context's)"
        )
        p.add_argument(
            "--kubeconfig",
            help="kubeconfig file (without it: $KUBECONFIG, else ~/.kube/config; in a pod, "
            "its service account)",
        )


def cmd_request(args: argparse.Namespace) -> int:
    """Writes the command's annotation on the VLLMDeployment (docs/gitops.md says why that is
    GitOps-safe); the operator acts on its next reconcile."""
    from datetime import UTC, datetime

    from kubernetes.client import ApiClient, CustomObjectsApi
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from vllm_autotuner import GROUP, VERSION
    from vllm_autotuner.adapters.kube import load_credentials
    from vllm_autotuner.core.commands import request_annotations

    try:
        credentials = load_credentials(args.kubeconfig)
    except Exception as exc:  # KubeconfigError, or OSError from a temporary file
        print(f"error: cannot load Kubernetes credentials: {exc}", file=sys.stderr)
        return 2
    namespace = args.namespace or credentials.namespace
    annotations = request_annotations(args.command, datetime.now(UTC))
    where = f"VLLMDeployment {namespace}/{args.name}"
    with ApiClient(credentials.configuration) as client:
        try:
            CustomObjectsApi(client).patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "vllmdeployments", args.name,
                {"metadata": {"annotations": annotations}},
                field_manager="vllm-autotuner-cli",
                _content_type="application/merge-patch+json",
            )  # fmt: skip
        except ApiException as exc:
            why = "not found" if exc.status == 404 else f"refused ({exc.status} {exc.reason})"
            print(f"error: {where}: {why}", file=sys.stderr)
            return 1
        except HTTPError as exc:
            print(f"error: cannot reach the API server: {exc}", file=sys.stderr)
            return 1
    ((key, value),) = annotations.items()
    shown = f"{key}={value}" if value is not None else f"{key} removed"
    print(f"{args.command}: {where} ({shown}); the operator acts on its next reconcile")
    return 0


def cmd_crds(args: argparse.Namespace) -> int:
    from vllm_autotuner.api import crds

    if args.out:
        written = crds.write_crds(args.out)
        for path in written:
            print(path)
    else:
        sys.stdout.write(crds.render_crds_yaml())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import kopf

    from vllm_autotuner.adapters.kube import load_credentials
    from vllm_autotuner.operator import OperatorConfig, run_operator

    log_format = {
        "plain": kopf.LogFormat.PLAIN,
        "full": kopf.LogFormat.FULL,
        "json": kopf.LogFormat.JSON,
    }[args.log_format]
    kopf.configure(verbose=args.verbose, log_format=log_format)
    if not args.verbose:
        # kopf logs every handler and activity run at INFO ("Handler 'spec_changed'
        # succeeded.", "Activity 'login' succeeded." at every re-login); the operator logs its
        # own decisions, so kopf's records about them show from WARNING on.
        for name in ("kopf.objects", "kopf.activities"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        credentials = load_credentials(args.kubeconfig)
    except Exception as exc:  # KubeconfigError, or OSError from a temporary file
        print(f"error: cannot load Kubernetes credentials: {exc}", file=sys.stderr)
        return 2
    config = OperatorConfig(
        credentials=credentials,
        reconcile_interval_s=args.reconcile_interval,
        request_timeout_s=args.request_timeout,
        prometheus_url=args.prometheus_url,
        prometheus_timeout_s=args.prometheus_timeout,
        prometheus_bearer_token_file=args.prometheus_bearer_token_file,
        prometheus_ca_file=args.prometheus_ca_file,
        prometheus_rate_scale=args.prometheus_rate_scale,
        prometheus_min_window_s=args.prometheus_min_window,
        metrics_port=args.metrics_port or None,
        performance_model=args.performance_model,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=peering_priority(os.environ.get("POD_NAME")) if args.peering else 0,
    )
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_operator(
            config,
            namespaces=list(args.namespace) or None,
            liveness_endpoint=liveness,
            stop_flag=stop,
        )

    asyncio.run(main())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "run":  # kopf configures logging for the operator itself
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    handlers = {
        "run": cmd_run,
        "crds": cmd_crds,
        "recommend": cmd_recommend,
        **dict.fromkeys(REQUESTS, cmd_request),
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

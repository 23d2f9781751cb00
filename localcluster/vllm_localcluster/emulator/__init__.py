"""A Kubernetes API emulator for the operator's integration tests, the demo and e2e.

No real kube-apiserver runs on this project's machines, so kmock (by kopf's author) is extended
with the semantics kopf, kubectl, the `kubernetes` client and our operator rely on.

Usage::

    with EmulatorServer() as server:            # or: async with EmulatorServer() as server
        server.emulator.register_crds_from("crds/")
        server.write_kubeconfig(tmp_path / "kubeconfig")
        ...
        server.emulator.get_object("apps/v1/deployments", "default", "llama")
        server.emulator.requests_matching(verb="patch", resource="vllmdeployments")

Standalone: ``python -m vllm_localcluster.emulator --port 0 --kubeconfig PATH [--crds DIR]``.

Emulated: discovery (built-ins from kmock's K3s snapshot, CRDs registered from manifests or
created through the API), create/get/list/update/patch (merge, strategic, JSON, server-side
apply)/delete/deletecollection, uid/resourceVersion/generation/creationTimestamp,
409 conflicts, status subresources, label and field selectors, limit/continue, watches with
resume, bookmarks, timeouts and 410 Gone, finalizers, ownerReference garbage collection
(Background, Foreground, Orphan), namespaces (auto-created by default; `auto_create_namespaces=
False` gives the real 404), CRD structural pruning and defaults, a request log and fault
injection.

Not emulated (use kind for these): authentication/RBAC enforcement, admission webhooks, CEL and
OpenAPI validation (no /openapi/v2: kubectl needs --validate=false), version conversion of CRs,
exact server-side-apply field ownership and conflicts (a manager's previously applied fields it
drops are removed; conflicts with other managers are never reported), Table output, and
controllers other than the garbage collector and namespace cleanup (no Deployment -> Pod).
"""

from vllm_localcluster.emulator.errors import ApiError
from vllm_localcluster.emulator.handler import (
    Fault,
    KubernetesAPIEmulator,
    RequestRecord,
    parse_api_path,
)
from vllm_localcluster.emulator.schema import ResourceType
from vllm_localcluster.emulator.server import EmulatorServer
from vllm_localcluster.emulator.store import ObjectStore

__all__ = [
    "ApiError",
    "EmulatorServer",
    "Fault",
    "KubernetesAPIEmulator",
    "ObjectStore",
    "RequestRecord",
    "ResourceType",
    "parse_api_path",
]

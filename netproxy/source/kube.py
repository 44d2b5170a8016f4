"""The Kubernetes API source: list-watch Services, EndpointSlices (or Endpoints), ServiceCIDRs and this node.

Objects are read as raw JSON and converted by :mod:`netproxy.source.convert`, the code the file
source uses, so a manifest and an API object can never be read differently.  An object that does not
convert is rejected (logged and counted by the tracker) and treated as absent: programming a stale
earlier version of it would be a guess, and after a relist there is no earlier version to fall back
on anyway.

Construct with an API client (see :func:`api_client_from`)::

    source = KubeSource(api_client, node_name, use_endpoints=False, families=("IPv4", "IPv6"))
    source.start(tracker)   # four daemon threads
    ...
    source.stop()
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

from netproxy.core.model import EndpointSet, IPNetwork, NodeInfo, ServicePort, ValidationError
from netproxy.core.tracker import ChangeTracker
from netproxy.source.convert import (
    PROXY_LABEL_SELECTOR,
    is_mapping,
    parse_endpoint_slice,
    parse_endpoints,
    parse_node,
    parse_service,
    parse_service_cidr,
)
from netproxy.source.files import Loaded, SourceError, merge, parse_part
from netproxy.source.kube_reflector import Handler, Obj, Reflector, ReflectorSettings, api_status

log = logging.getLogger(__name__)

Key = Tuple[str, str]


def object_key(obj: Mapping[str, Any]) -> Optional[Key]:
    """(namespace, name) straight from metadata, unvalidated: a delete must find what an add stored."""
    meta = obj.get("metadata") if is_mapping(obj) else None
    if not is_mapping(meta) or not isinstance(meta.get("name"), str):
        return None
    namespace = meta.get("namespace") or "default"
    return (namespace, meta["name"]) if isinstance(namespace, str) else None


COLLECTIONS = {
    "Service": "/api/v1/services",
    "Endpoints": "/api/v1/endpoints",
    "EndpointSlice": "/apis/discovery.k8s.io/v1/endpointslices",
    "Node": "/api/v1/nodes",
    "ServiceCIDR": "/apis/networking.k8s.io/v1/servicecidrs",
}
"""The cluster-wide collections netproxy lists and watches, by kind."""

_QUERY = {"label_selector": "labelSelector", "field_selector": "fieldSelector", "limit": "limit",
          "_continue": "continue", "watch": "watch", "resource_version": "resourceVersion",
          "allow_watch_bookmarks": "allowWatchBookmarks", "timeout_seconds": "timeoutSeconds"}


def lister(api_client: Any, kind: str) -> Callable[..., Any]:
    """A list/watch function for ``kind`` taking the typed API methods' keyword arguments (e.g.
    ``CoreV1Api.list_service_for_all_namespaces(..., _preload_content=False)``) and answering as they
    do — the raw urllib3 response, an ``ApiException`` for a status that is not 2xx — through the
    client's own request machinery (configuration, credentials, TLS, timeouts), without its typed API
    classes: their first use imports every model class they name, measured at 0.8 s and 21 MB of a
    `run`'s start (docs/performance.md) for objects that netproxy reads as raw JSON anyway."""
    from kubernetes.client.exceptions import ApiException

    path = COLLECTIONS[kind]

    def call(_preload_content: bool = False, _request_timeout: Any = None, **kwargs: Any) -> Any:
        if _preload_content:
            raise ValueError("netproxy reads list and watch responses raw")
        query = [(_QUERY[k], v) for k, v in kwargs.items() if v is not None]
        request = api_client.param_serialize(method="GET", resource_path=path, query_params=query,
                                             header_params={"Accept": "application/json"},
                                             auth_settings=["BearerToken"])
        resp = api_client.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    return call


class Collection(NamedTuple):
    kind: str
    kwargs: Dict[str, Any]
    needed: bool = True
    """False: a one-shot command goes on without it when the server refuses it (403, 404)."""
    instead: Optional[str] = None
    """For ``run``: what netproxy does while the server does not serve it (404) or may not show it
    (403), said once and checked again slowly.  None: a refusal is retried with backoff."""


def collections(node_name: str, use_endpoints: bool) -> List[Collection]:
    """What netproxy reads from the API, for ``run``'s watches and the one-shot commands' lists alike:
    Services and EndpointSlices (or Endpoints) with kube-proxy's informer filter (services of another
    proxy and headless services' slices are never listed, held or woken for), this node's Node, and
    networking.k8s.io/v1 ServiceCIDRs (Kubernetes >= 1.33: the service CIDRs whose unowned addresses
    are dropped; not a readiness condition, without them only the drop is missing)."""
    mine = {"label_selector": PROXY_LABEL_SELECTOR}
    return [Collection("Service", mine),
            Collection("Endpoints" if use_endpoints else "EndpointSlice", mine),
            Collection("Node", {"field_selector": f"metadata.name={node_name}"}, needed=False),
            Collection("ServiceCIDR", {}, needed=False,
                       instead="netproxy uses --service-cluster-ip-range alone for the service CIDRs")]


class ServiceHandler:
    """Services → tracker.update_service / replace_services."""

    def __init__(self, tracker: ChangeTracker) -> None:
        self.tracker = tracker
        self._synced = False

    def _convert(self, obj: Obj) -> Tuple[Optional[Key], Optional[Tuple[ServicePort, ...]]]:
        key = object_key(obj)
        try:
            return key, parse_service(obj)
        except ValidationError as err:
            self.tracker.reject(err)
            return key, None

    def replace(self, items: Iterator[Obj]) -> None:
        services: Dict[Key, Tuple[ServicePort, ...]] = {}
        for obj in items:
            key, ports = self._convert(obj)
            if key is not None and ports is not None:
                services[key] = ports
        self.tracker.replace_services(services)
        if not self._synced:
            self._synced = True
            self.tracker.services_synced()

    def apply(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            key, ports = object_key(obj), None
        else:
            key, ports = self._convert(obj)
        if key is not None:
            self.tracker.update_service(key[0], key[1], ports)


class SliceHandler:
    """EndpointSlices (or, with ``legacy``, v1 Endpoints) → tracker.update_endpoints / replace_endpoints.

    Slices are keyed by their own name; the tracker merges a service's slices and dedupes endpoints.
    A slice of an address type this node does not serve converts to None and is treated as absent.
    """

    def __init__(self, tracker: ChangeTracker, families: Tuple[str, ...], legacy: bool = False) -> None:
        self.tracker = tracker
        self.families = families
        self.legacy = legacy
        self._synced = False

    def _convert(self, obj: Obj) -> Tuple[Optional[Key], Optional[EndpointSet]]:
        key = object_key(obj)
        try:
            if self.legacy:
                return key, self._legacy(parse_endpoints(obj))
            return key, parse_endpoint_slice(obj, self.families, cache=False)
        except ValidationError as err:
            self.tracker.reject(err)
            return key, None

    def _legacy(self, eps: EndpointSet) -> EndpointSet:
        # v1 Endpoints mix families in one object; keep only the ones this node serves.
        wanted = {4 if f == "IPv4" else 6 for f in self.families}
        kept = tuple(e for e in eps.endpoints if e.ip.version in wanted)
        return eps if len(kept) == len(eps.endpoints) else EndpointSet(eps.namespace, eps.service, eps.ports, kept)

    def replace(self, items: Iterator[Obj]) -> None:
        sets: Dict[Key, EndpointSet] = {}
        for obj in items:
            key, eps = self._convert(obj)
            if key is not None and eps is not None:
                sets[key] = eps
        self.tracker.replace_endpoints(sets)
        if not self._synced:
            self._synced = True
            self.tracker.endpoints_synced()

    def apply(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            key, eps = object_key(obj), None
        else:
            key, eps = self._convert(obj)
        if key is not None:
            self.tracker.update_endpoints(key[0], key[1], eps)


class NodeHandler:
    """This node's ``v1 Node`` (a field-selected list-watch) → tracker.set_node, only when it changes.

    Nodes are modified often (status, leases, images); only the zone label matters here, so unchanged
    NodeInfo is not passed on, and a missing node leaves a NodeInfo without zone.
    """

    def __init__(self, tracker: ChangeTracker, node_name: str) -> None:
        self.tracker = tracker
        self.node_name = node_name
        self._last: Optional[NodeInfo] = None

    def node_info(self, obj: Optional[Obj]) -> NodeInfo:
        if obj is None:
            return NodeInfo(self.node_name)
        try:
            return parse_node(obj, self.node_name)
        except ValidationError as err:
            self.tracker.reject(err)
            return NodeInfo(self.node_name)

    def _set(self, info: NodeInfo) -> None:
        if info != self._last:
            self._last = info
            self.tracker.set_node(info)

    def _mine(self, obj: Obj) -> bool:
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        return isinstance(meta, Mapping) and meta.get("name") == self.node_name

    def replace(self, items: Iterator[Obj]) -> None:
        found: Optional[Obj] = None
        for obj in items:
            if self._mine(obj):
                found = obj
        if found is None:
            log.warning("node %r not found in the API; topology hints are off until it appears", self.node_name)
        self._set(self.node_info(found))

    def apply(self, event_type: str, obj: Obj) -> None:
        if not self._mine(obj):
            return
        self._set(self.node_info(None if event_type == "DELETED" else obj))


class ServiceCIDRHandler:
    """networking.k8s.io/v1 ServiceCIDRs (cluster-scoped) → tracker.update_service_cidr /
    replace_service_cidrs.  Every object's ``spec.cidrs`` counts, whatever its status, as in
    kube-proxy's ServiceCIDR handler; one that does not convert is rejected and treated as absent."""

    def __init__(self, tracker: ChangeTracker) -> None:
        self.tracker = tracker

    def _convert(self, obj: Obj) -> Tuple[Optional[str], Optional[Tuple[IPNetwork, ...]]]:
        key = object_key(obj)
        try:
            return (key[1] if key else None), parse_service_cidr(obj)[1]
        except ValidationError as err:
            self.tracker.reject(err)
            return (key[1] if key else None), None

    def replace(self, items: Iterator[Obj]) -> None:
        found: Dict[str, Tuple[IPNetwork, ...]] = {}
        for obj in items:
            name, cidrs = self._convert(obj)
            if name is not None and cidrs is not None:
                found[name] = cidrs
        self.tracker.replace_service_cidrs(found)

    def apply(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            key = object_key(obj)
            name, cidrs = (key[1] if key else None), None
        else:
            name, cidrs = self._convert(obj)
        if name is not None:
            self.tracker.update_service_cidr(name, cidrs)


class KubeSource:
    """Keeps a tracker up to date with the cluster: four reflectors in daemon threads."""

    def __init__(self, api_client: Any, node_name: str, use_endpoints: bool = False,
                 families: Tuple[str, ...] = ("IPv4", "IPv6"),
                 settings: Optional[ReflectorSettings] = None) -> None:
        for family in families:
            if family not in ("IPv4", "IPv6"):
                raise ValueError(f"family {family!r} is not IPv4 or IPv6")
        self.api_client = api_client
        self.node_name = node_name
        self.use_endpoints = use_endpoints
        self.families = tuple(families)
        self.settings = settings or ReflectorSettings()
        self.reflectors: List[Reflector] = []

    def start(self, tracker: ChangeTracker) -> None:
        def handler(kind: str) -> Handler:
            if kind == "Service":
                return ServiceHandler(tracker)
            if kind in ("Endpoints", "EndpointSlice"):
                return SliceHandler(tracker, self.families, legacy=kind == "Endpoints")
            return NodeHandler(tracker, self.node_name) if kind == "Node" else ServiceCIDRHandler(tracker)

        self.reflectors = [Reflector(c.kind, lister(self.api_client, c.kind), handler(c.kind), self.settings,
                                     list_kwargs=c.kwargs, instead=c.instead)
                           for c in collections(self.node_name, self.use_endpoints)]
        log.info("watching services, %s, servicecidrs and node %s",
                 "endpoints" if self.use_endpoints else "endpointslices", self.node_name)
        for r in self.reflectors:
            r.start()

    def stop(self) -> None:
        for r in self.reflectors:
            r.signal_stop()
        for r in self.reflectors:
            r.stop()


def read_node(api_client: Any, node_name: str) -> Optional[NodeInfo]:
    """This node's Node, read once (None when it does not exist or cannot be read yet): what the
    configuration takes from it at start (``--detect-local-mode NodeCIDR``, ``--nodeport-addresses
    primary``) before the watches run."""
    import json

    try:
        resp: Any = lister(api_client, "Node")(field_selector=f"metadata.name={node_name}", _request_timeout=(5, 10))
        try:
            items = json.loads(resp.data).get("items") or []
        finally:
            resp.release_conn()
    except Exception as err:  # noqa: BLE001 - the caller waits and asks again
        log.warning("cannot read the Node %s: %s", node_name, err)
        return None
    if not items:
        return None
    try:
        return parse_node(items[0], node_name)
    except ValidationError as err:
        log.error("rejected %s", err)
        return None


def api_client_from(kubeconfig: Optional[str] = None, context: Optional[str] = None) -> Any:
    """An ApiClient from a kubeconfig file, or the pod's service account when run in a cluster.

    Raises ValueError when neither is available, naming what was tried.
    """
    from kubernetes import client, config

    if kubeconfig:
        api = config.new_client_from_config(  # type: ignore[no-untyped-call]  # the client is untyped
            config_file=kubeconfig, context=context)
        token_file = kubeconfig_token_file(kubeconfig, context)
        if token_file:
            reread_token(api.configuration, token_file)
        return api
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return client.ApiClient(cfg)
    raise ValueError("no --kubeconfig given and not running in a cluster (KUBERNETES_SERVICE_HOST unset)")


TOKEN_REREAD_SECONDS = 60.0
"""How often a kubeconfig's ``tokenFile`` is read again (client-go's cached file token: one minute)."""


def kubeconfig_token_file(kubeconfig: str, context: Optional[str] = None) -> Optional[str]:
    """The ``tokenFile`` the kubeconfig's user authenticates with (relative to the kubeconfig), or None
    when it authenticates otherwise (an inline token, exec, an auth provider, certificates)."""
    import yaml

    with open(kubeconfig, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    name = context or doc.get("current-context")
    ctx = next((c.get("context") or {} for c in doc.get("contexts") or [] if c.get("name") == name), {})
    user = next((u.get("user") or {} for u in doc.get("users") or [] if u.get("name") == ctx.get("user")), {})
    path = user.get("tokenFile")
    if not isinstance(path, str) or not path or any(k in user for k in ("token", "exec", "auth-provider")):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(kubeconfig)), path)


def reread_token(configuration: Any, path: str) -> None:
    """Make the client read ``path`` again, at most every TOKEN_REREAD_SECONDS, before a request.

    The Python client reads a kubeconfig's ``tokenFile`` once; the kubelet rotates a pod's projected
    service-account token (kubeadm's kube-proxy ``kubeconfig.conf`` points at one), and client-go
    re-reads the file, so a long-running proxy must too.  A file that cannot be read keeps the token
    held (logged): the API server says when it has expired."""
    import time

    last = [float("-inf")]

    def refresh(cfg: Any) -> None:
        now = time.monotonic()
        if now - last[0] < TOKEN_REREAD_SECONDS:
            return
        last[0] = now
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as err:
            log.warning("kubeconfig tokenFile %s not re-read: %s", path, err)
            return
        if token:
            cfg.api_key["BearerToken"] = f"Bearer {token}"

    refresh(configuration)  # now too: trimmed, as client-go trims it (the client keeps a final newline)
    configuration.refresh_api_key_hook = refresh


class _Collect:
    """A reflector's handler for one list: its objects converted as the file source converts them."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.loaded: Optional[Loaded] = None

    def replace(self, items: Iterator[Obj]) -> None:
        self.loaded = parse_part(items, self.node_name)

    def apply(self, event_type: str, obj: Obj) -> None:  # a one-time list has no watch
        raise AssertionError("a one-time list has no watch events")


def load_once(api_client: Any, node_name: str, use_endpoints: bool = False,
              settings: Optional[ReflectorSettings] = None) -> Loaded:
    """One consistent read of the cluster for the one-shot commands (``sync``, ``plan``, ``trace``,
    ``migrate`` with ``--kubeconfig``): the lists ``run`` starts from, with the same informer filter,
    converted as a manifest would be; :class:`SourceError` names a collection that could not be listed."""
    settings = settings or ReflectorSettings()
    parts: List[Loaded] = []
    for c in collections(node_name, use_endpoints):
        collect = _Collect(node_name)
        try:
            Reflector(c.kind, lister(api_client, c.kind), collect, settings, list_kwargs=c.kwargs).list_once()
        except Exception as err:  # noqa: BLE001 - any failure to list is named, then judged
            if not c.needed and api_status(err) in (403, 404):
                log.warning("%s: not listed (HTTP %s): %s", c.kind, api_status(err),
                            c.instead or "this node's labels (its zone) are not known")
                continue
            raise SourceError(f"the Kubernetes API: listing {c.kind} failed: {err}") from None
        if collect.loaded is not None:
            parts.append(collect.loaded)
    return merge(parts)

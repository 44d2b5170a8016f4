"""List-watch of one Kubernetes collection: client-go's reflector, in a thread.

One :class:`Reflector` lists a collection page by page (``limit``/``continue``), hands every item to
its handler as one replacement, then watches from the list's ``resourceVersion`` with bookmarks.
After a dropped connection or a 5xx it resumes the watch from the last resourceVersion it applied, so
no event is lost and none is applied twice; after ``410 Gone`` (as an HTTP status or as an ``ERROR``
event in the stream) it relists, and the replacement removes whatever vanished meanwhile.  Failures
back off exponentially with jitter, capped.

Responses are read as raw JSON (``_preload_content=False``): the client's model deserialisation is
several times slower than ``json.loads`` at 10k objects and we convert dicts anyway, with the same
code as the file source (:mod:`netproxy.source.convert`).
"""

from __future__ import annotations

import json
import logging
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import msgspec

from netproxy.source.kube_schema import SHAPES

log = logging.getLogger(__name__)

# A client list function, e.g. CoreV1Api.list_service_for_all_namespaces, with its keyword arguments.
ListFunc = Callable[..., Any]
Obj = Dict[str, Any]


class Decoder:
    """List pages and watch events of one kind, decoded into :mod:`kube_schema`'s shapes where it
    has one (the fields netproxy reads, the rest skipped in C), whole with ``json`` otherwise and
    whenever the shaped decoding refuses the text, so that conversion judges it object by object."""

    def __init__(self, kind: str) -> None:
        shapes = SHAPES.get(kind)
        self._page = msgspec.json.Decoder(shapes[0]) if shapes else None
        self._event = msgspec.json.Decoder(shapes[1]) if shapes else None

    def page(self, data: bytes) -> Any:
        if self._page is not None:
            try:
                return self._page.decode(data)
            except msgspec.MsgspecError:
                pass  # a container of another shape: the plain decoder, and conversion, will say
        return json.loads(data)

    def event(self, line: bytes) -> Any:
        if self._event is not None:
            try:
                event = self._event.decode(line)
                if event.get("type") != "ERROR":  # an ERROR's object is a Status: read it whole
                    return event
            except msgspec.MsgspecError:
                pass
        return json.loads(line)


class Handler(Protocol):
    """What a reflector feeds: one replacement per (re)list, then one call per watch event."""

    def replace(self, items: Iterator[Obj]) -> None:
        """Every object of the collection.  Must apply nothing if iterating raises (a failed list)."""

    def apply(self, event_type: str, obj: Obj) -> None:
        """One ``ADDED``, ``MODIFIED`` or ``DELETED`` event, in the order the server sent them."""


class Expired(Exception):
    """The resourceVersion we hold is too old (410 Gone): relist."""


class WatchError(Exception):
    """An ``ERROR`` event other than 410 in a watch stream, or a malformed stream."""


@dataclass(frozen=True)
class ReflectorSettings:
    """Timing of lists and watches; client-go's defaults, smaller values in tests."""

    page_size: int = 500
    watch_timeout: float = 300.0
    """Server-side timeout of one watch request; randomised up to 2x so that nodes spread out."""
    read_slack: float = 30.0
    """Client read timeout beyond the watch timeout: a silent, half-dead connection is noticed."""
    connect_timeout: float = 10.0
    list_timeout: float = 120.0
    backoff_initial: float = 0.8
    backoff_cap: float = 30.0
    backoff_jitter: float = 1.0
    absent_recheck: float = 300.0
    """Seconds between checks of an optional resource the server does not serve (404) or the
    service account may not read (403): it may appear after an upgrade or an RBAC change."""


class Backoff:
    """Capped exponential backoff with jitter: delay n is min(cap, initial * 2**n) * (1 + jitter * U[0,1))."""

    def __init__(self, initial: float, cap: float, jitter: float,
                 rand: Callable[[], float] = random.random) -> None:
        self.initial = initial
        self.cap = cap
        self.jitter = jitter
        self.rand = rand
        self.failures = 0

    def next_delay(self) -> float:
        base = min(self.cap, self.initial * (1 << min(self.failures, 32)))
        self.failures += 1
        return base * (1.0 + self.jitter * self.rand())

    def reset(self) -> None:
        self.failures = 0


def iter_lines(resp: Any) -> Iterator[bytes]:
    """Newline-separated JSON documents of a chunked watch response, however the chunks split them."""
    pending = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        if not chunk:
            continue
        pending += chunk
        if b"\n" not in chunk:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def api_status(exc: BaseException) -> Optional[int]:
    """The HTTP status of a client ApiException, None for a transport error."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None


class Reflector:
    """List-watches one collection in a daemon thread and feeds a :class:`Handler`."""

    def __init__(self, kind: str, list_func: ListFunc, handler: Handler,
                 settings: ReflectorSettings = ReflectorSettings(),
                 list_kwargs: Optional[Dict[str, Any]] = None,
                 rand: Callable[[], float] = random.random, instead: Optional[str] = None) -> None:
        """``instead``: for an optional resource, what netproxy does while the server does not
        serve it (404) or may not show it (403); said once, then checked every ``absent_recheck``."""
        self.kind = kind
        self.decoder = Decoder(kind)
        self.instead = instead
        self._said: Optional[Tuple[Optional[int], str]] = None
        self.list_func = list_func
        self.handler = handler
        self.settings = settings
        self.list_kwargs = dict(list_kwargs or {})
        self.rand = rand
        self.backoff = Backoff(settings.backoff_initial, settings.backoff_cap, settings.backoff_jitter, rand)
        self.resource_version: Optional[str] = None
        self.lists = 0  # counters for tests and metrics
        self.watches = 0
        self.errors = 0
        self._stop = threading.Event()
        self._resp_lock = threading.Lock()
        self._resp: Any = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"reflector-{self.kind}", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Ask the thread to end, and unblock a watch read in progress."""
        self._stop.set()
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            _interrupt(resp)

    def stop(self, timeout: float = 5.0) -> None:
        self.signal_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """The thread body: list, watch, and recover, until stopped."""
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self.resource_version = self.list_once()
                    self.backoff.reset()
                    self._said = None  # a refusal after this is news again
                self.watch_once(self.resource_version)
                # A watch that ended normally (the server's timeout) is healthy; so is one that
                # delivered an event (see _event).  A server that accepts and drops at once is not.
                self.backoff.reset()
            except Expired as err:
                # Not a failure: the server compacted past our version.  Relist at once after a watch;
                # after a list whose continue token expired, wait first, so that a server that keeps
                # expiring tokens (a tiny compaction window) is not hammered with lists.
                listing = self.resource_version is None
                self.resource_version = None
                delay = self.backoff.next_delay() if listing else 0.0
                log.info("%s: %s; relisting%s", self.kind, err, f" in {delay:.1f}s" if delay else "")
                self._stop.wait(delay)
            except Exception as err:  # noqa: BLE001 - any failure is retried; the thread must live
                if self._stop.is_set():
                    break
                self.errors += 1
                self._stop.wait(self._failed(err))

    def _failed(self, err: BaseException) -> float:
        """Log a failed request and return how long to wait before the next attempt.  A transport
        error or a server error is logged at every retry (an outage shows its backoff); a refusal
        (401/403/404) once until it changes, since repeating it every few seconds says nothing new."""
        status = api_status(err)
        verb = "list" if self.resource_version is None else "watch"
        if status in (403, 404) and self.instead is not None:
            delay = self.settings.absent_recheck
            why = "does not serve it" if status == 404 else "refuses it to this account"
            self._say_once(logging.WARNING, status, f"{self.kind}: the API server {why} ({_describe(err)}); "
                           f"{self.instead}; checking again every {delay:g}s")
            return delay
        delay = self.backoff.next_delay()
        if status in (401, 403, 404):
            self._say_once(logging.ERROR, status, f"{self.kind}: {verb} refused ({_describe(err)}); "
                           f"retrying with backoff (last delay {delay:.1f}s)")
        else:
            self._said = None
            log.warning("%s: %s failed (%s); retrying in %.1fs", self.kind, verb, _describe(err), delay)
        return delay

    def _say_once(self, level: int, status: Optional[int], what: str) -> None:
        if self._said is not None and self._said[0] == status:
            log.debug("%s (again)", what)
            return
        log.log(level, "%s", what)
        self._said = (status, what)

    # -- list -----------------------------------------------------------------------------------

    def list_once(self) -> str:
        """List every page, hand the items to the handler in one replacement; return the list's version."""
        result: Dict[str, str] = {}
        self.handler.replace(self._pages(result))
        self.lists += 1
        return result["resourceVersion"]

    def _pages(self, result: Dict[str, str]) -> Iterator[Obj]:
        """Every item of every page.  The next page is requested as soon as the current one's
        continue token is known, in a helper thread, so the server builds it (and the network
        carries it) while this thread converts the current one: at 10k services the server's share
        is hidden rather than added."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"list-{self.kind}")
        try:
            pending: Optional[Future[Tuple[List[Obj], Dict[str, Any]]]] = pool.submit(self._page, None)
            while pending is not None:
                if self._stop.is_set():
                    # Stopped half-way: raising keeps the handler from applying a partial list.
                    raise InterruptedError(f"{self.kind}: stopped during a list")
                items, meta = pending.result()
                cont = meta.get("continue") or None
                pending = pool.submit(self._page, cont) if cont else None
                for item in items:
                    # Items of a list carry no kind (the list does); conversion needs it for messages
                    # and for name rules (an EndpointSlice name is a subdomain, a Service name a label).
                    if isinstance(item, dict):
                        item.setdefault("kind", self.kind)
                    yield item  # a non-object item is the handler's to reject: the list must not fail
                del items
                if not cont:
                    result["resourceVersion"] = str(meta.get("resourceVersion") or "")
        finally:
            # A list abandoned half-way (the handler failed, or a stop) leaves its prefetch behind
            # rather than waiting for it: its answer is dropped when it comes.
            pool.shutdown(wait=False, cancel_futures=True)

    def _page(self, cont: Optional[str]) -> Tuple[List[Obj], Dict[str, Any]]:
        """One page of the list: its items and its list metadata."""
        kwargs = dict(self.list_kwargs, limit=self.settings.page_size, _preload_content=False,
                      _request_timeout=(self.settings.connect_timeout, self.settings.list_timeout))
        if cont:
            kwargs["_continue"] = cont
        try:
            resp = self.list_func(**kwargs)
        except Exception as err:
            if api_status(err) == 410:
                # The continue token expired: a consistent list must start over.
                raise Expired(f"list continue token expired: {_describe(err)}") from None
            raise
        try:
            body = self.decoder.page(resp.data)
        finally:
            resp.release_conn()
        if not isinstance(body, dict):
            raise WatchError(f"{self.kind}: a list page that is not a JSON object")
        meta = body.get("metadata")
        items = body.get("items")
        return (items if isinstance(items, list) else []), (meta if isinstance(meta, dict) else {})

    # -- watch ----------------------------------------------------------------------------------

    def watch_once(self, resource_version: str) -> None:
        """One watch request from ``resource_version``; returns when the server ends it."""
        timeout = int(self.settings.watch_timeout * (1.0 + self.rand()))
        try:
            resp = self.list_func(**dict(
                self.list_kwargs, watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                timeout_seconds=max(1, timeout), _preload_content=False,
                _request_timeout=(self.settings.connect_timeout, timeout + self.settings.read_slack)))
        except Exception as err:
            # A server may refuse the version with the request's status rather than an ERROR event in
            # a 200 stream (kube-apiserver v1.36 sends the event; client-go takes both): relist, as
            # for the event.  Retrying the same version would be refused forever.
            if api_status(err) == 410:
                raise Expired(f"watch expired: {_describe(err)}") from None
            raise
        with self._resp_lock:
            self._resp = resp
        self.watches += 1
        try:
            if self._stop.is_set():
                return
            for line in iter_lines(resp):
                self._event(line)
                if self._stop.is_set():
                    return
        finally:
            with self._resp_lock:
                self._resp = None
            resp.release_conn()

    def _event(self, line: bytes) -> None:
        try:
            event = self.decoder.event(line)
            event_type = event["type"]
            obj = event["object"]
        except (ValueError, KeyError, TypeError):
            raise WatchError(f"malformed watch event {line[:200]!r}") from None
        if event_type == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            message = obj.get("message") if isinstance(obj, dict) else obj
            if code == 410:
                raise Expired(f"watch expired: {message}")
            raise WatchError(f"watch error {code}: {message}")
        rv = ((obj.get("metadata") or {}) if isinstance(obj, dict) else {}).get("resourceVersion")
        if event_type == "BOOKMARK":
            # Only the version is meaningful: resuming from it skips nothing we care about.
            if rv:
                self.resource_version = str(rv)
            self.backoff.reset()
            return
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring watch event of type %r", self.kind, event_type)
            return
        self.handler.apply(event_type, obj)
        # Advanced only after the handler applied it: a drop before this line replays the event.
        if rv:
            self.resource_version = str(rv)
        self.backoff.reset()


def _interrupt(resp: Any) -> None:
    """Unblock a thread reading ``resp`` (a urllib3 response) from another thread."""
    shutdown = getattr(resp, "shutdown", None)  # urllib3 >= 2.3
    try:
        if shutdown is not None:
            shutdown()
        else:
            resp.close()
    except Exception as err:  # noqa: BLE001 - best effort at stop
        log.debug("interrupting a watch: %s", err)


def _describe(err: BaseException) -> str:
    status = api_status(err)
    if status is not None:
        reason = getattr(err, "reason", "") or ""
        return f"HTTP {status} {reason}".strip()
    return f"{type(err).__name__}: {err}"

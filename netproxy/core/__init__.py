"""The sync core: the model of services and endpoints, the proxy's configuration and feature gates,
the change tracker, endpoint selection, the proxier that turns changes into backend syncs, and the
bounded-frequency runner that paces them.  It knows the backend interface (``netproxy.backends.base``)
and nothing of any backend's internals, the sources, the node or the CLI."""

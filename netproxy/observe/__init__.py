"""What operators read: Prometheus metrics under kube-proxy's names, /healthz and the services'
health-check node ports, the z-pages, ``netproxy status`` and the log format."""

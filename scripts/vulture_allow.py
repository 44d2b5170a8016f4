# ruff: noqa
# type: ignore
"""vulture's allow-list (scripts/lint-structure), in vulture's whitelist form: names the product
defines for a framework or library that reads them by reflection, so that no caller of ours names them."""

_ = object()
# socketserver / http.server read these class attributes and call these hooks on the handler.
_.daemon_threads
_.allow_reuse_address
_.address_family
_.do_GET
_.log_message
# msgspec fills these TypedDict shapes by field name (netproxy/source/kube_schema.py): the API's fields.
_.annotations
_.resourceVersion
_.deletionTimestamp
_.nodeName
_.addressType
_.apiVersion  # netproxy/source/jsonstream.py: a List's frame
# The kubernetes client's Configuration reads this hook; python-iptables' Rule takes this attribute.
_.refresh_api_key_hook
_.in_interface

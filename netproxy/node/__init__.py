"""The node's facts and set-up: what the kernel and tools can do (detection, version skew), the
node's addresses, sysctls and conntrack limits, the conntrack reconciler over ctnetlink, and the
userspace relay for NodePorts on localhost."""

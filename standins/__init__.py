"""Stand-ins for the peers no CI machine has: the API server, the kubelet, kube-scheduler's extender
driver and a simulated GPU node, plus the loopback demo composed from them.

Tests, benchmarks and ``vramshare demo`` use them; no daemon imports them, and they never import the
command's composition (``vramshare_cli``). Each models the upstream
peer it replaces (the upstream function is named where an ordering, retry or failure is reproduced).
"""

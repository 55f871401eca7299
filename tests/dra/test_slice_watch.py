"""The DRA plugin's slice watch against a network that goes silent (issue 21: one list+watch adapter)."""
from __future__ import annotations

import threading

from deviceplugin.dra.publisher import SliceWatch
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCESLICES
from tests.standins.tcp_proxy import TcpProxy
from vramshare import contract
from vramshare.kube import api_client_for

NAMES = contract.Names()


def _slice(name: str, node: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": NAMES.dra_driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                           "resourceSliceCount": 1}}}


def test_a_silent_connection_is_noticed_and_a_slice_wiped_meanwhile_comes_back():
    """The slice watch had no read timeout: when its connection went silent (the API server's node gone,
    no FIN), it waited on it for ever, and slices the kubelet wiped meanwhile never came back. Now the
    watch request reads for its timeoutSeconds plus the request timeout, then relists on a new
    connection, and the relist reports the wipe."""
    with ApiServerDouble() as api, TcpProxy(int(api.url.rsplit(":", 1)[1])) as proxy, \
            api_client_for(proxy.url) as http:
        api.create(_slice("n1-slice-0", "n1"))
        gone, stop = threading.Event(), threading.Event()
        watch = SliceWatch(http, "n1", NAMES, on_gone=gone.set, watch_timeout_s=1)
        thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
        thread.start()
        try:
            assert gone.wait(10), "the first list reports nothing"
            assert api.wait_for_watches(1, timeout=10)
            gone.clear()
            proxy.freeze()  # the open watch hears nothing more, and never hears that it ended
            api.delete(RESOURCESLICES, None, "n1-slice-0")  # the kubelet's wipe, unseen
            assert gone.wait(20), "the slice watch still waits on a dead connection"
            assert proxy.accepted >= 2
        finally:
            stop.set()
            watch.stop()
            thread.join(timeout=10)

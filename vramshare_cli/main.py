"""The one ``vramshare`` command. Each subcommand is a thin entry point that wires adapters to the core.

Parsers live here so ``vramshare --help`` is the whole map for an admin; the work is imported lazily,
so ``vramshare extender`` never loads NVML and ``vramshare device-plugin`` never loads matplotlib.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from vramshare import __version__, contract, logs, traces
from vramshare.errors import UsageError

_DESCRIPTION = """\
vramshare shares NVIDIA GPUs between Kubernetes pods by memory.

  device-plugin  the node DaemonSet: advertises GPU memory units, MIG instances and whole GPUs
                 to the kubelet and hands each container the GPU the scheduler chose
  dra-plugin     the node DaemonSet for Kubernetes 1.36+: GPU memory as DRA consumable capacity
                 (ResourceSlices, NodePrepareResources, one CDI spec per claim)
  extender       the kube-scheduler HTTP extender: filter, prioritize and bind by free VRAM per GPU
  simulate       replay a production trace through the extender's placement code, compare policies
  demo           everything on loopback with simulated GPUs: no cluster and no GPU needed
  inspect        print per-GPU usage from a running extender's /inspect endpoint
  check          check a cluster before or after installing: one line per check with the fix
  install        print every manifest an install needs, for '| kubectl apply -f -'
  traces         download the public traces simulate and the benchmarks replay, or show where they are

Run 'vramshare <command> --help' for the options of one command.
"""


DEMO_PODS = 8  # the demo's pod shapes (standins.demo.PODS; a test keeps the two equal)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramshare", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"vramshare {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("VRAMSHARE_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"], help="log verbosity (default info)")
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    dp = sub.add_parser("device-plugin", help="run the node device plugin (DaemonSet)",
                        description="Discover GPUs, serve them to the kubelet over the device plugin API "
                                    "v1beta1, publish the node's GPU inventory, and hand each container its GPU.")
    dp.add_argument("--backend", choices=["nvml", "simulated", "auto"], default="auto",
                    help="where GPUs come from: NVML (real driver), a simulated inventory file, or auto "
                         "(NVML when a driver answers, else fail; simulated only when --inventory is given)")
    dp.add_argument("--inventory", metavar="FILE", help="simulated GPU inventory YAML (for --backend simulated)")
    dp.add_argument("--config", metavar="FILE", default=os.environ.get("VRAMSHARE_CONFIG"),
                    help="versioned config YAML (version: v1); reloaded on SIGHUP and when the file changes")
    dp.add_argument("--device-plugin-dir", metavar="DIR", default=contract.DEVICE_PLUGIN_DIR,
                    help=f"kubelet device plugin directory (default {contract.DEVICE_PLUGIN_DIR})")
    dp.add_argument("--pod-resources-socket", metavar="PATH", default=contract.POD_RESOURCES_SOCKET,
                    help="kubelet PodResources socket: the devices each pod really holds, read at start, "
                         f"every 2 s and after each Allocate (default {contract.POD_RESOURCES_SOCKET})")
    dp.add_argument("--quota-dir", metavar="DIR", help="host directory of per-container quota files "
                    f"(default from config, {contract.HOST_QUOTA_ROOT})")
    dp.add_argument("--node-name", metavar="NAME", default=os.environ.get("NODE_NAME"),
                    help="this node's name (default $NODE_NAME)")
    dp.add_argument("--kubeconfig", metavar="FILE", default=os.environ.get("KUBECONFIG"),
                    help="kubeconfig; without it and outside a cluster the plugin runs standalone")
    dp.add_argument("--metrics-port", type=int, default=9401, metavar="N",
                    help="Prometheus /metrics port, 0 to disable (default 9401)")

    dra = sub.add_parser("dra-plugin", help="run the DRA kubelet plugin (DaemonSet, Kubernetes 1.36+)",
                         description="Publish this node's GPUs as resource.k8s.io/v1 ResourceSlices (shared GPUs "
                                     "with consumable memory), register with the kubelet and prepare claims "
                                     "(one CDI spec per claim). Serves the GPUs the config's dra.gpus lists.")
    dra.add_argument("--backend", choices=["nvml", "simulated", "auto"], default="auto",
                     help="where GPUs come from, as for device-plugin")
    dra.add_argument("--inventory", metavar="FILE", help="simulated GPU inventory YAML (for --backend simulated)")
    dra.add_argument("--config", metavar="FILE", default=os.environ.get("VRAMSHARE_CONFIG"),
                     help="versioned config YAML (version: v1), the device plugin's; reloaded on change and SIGHUP")
    dra.add_argument("--kubeconfig", metavar="FILE", default=os.environ.get("KUBECONFIG"),
                     help="kubeconfig (default: in-cluster service account); the plugin needs an API server")
    dra.add_argument("--node-name", metavar="NAME", default=os.environ.get("NODE_NAME"),
                     help="this node's name (default $NODE_NAME)")
    dra.add_argument("--plugin-dir", metavar="DIR",
                     help=f"directory of the DRA socket (default {contract.KUBELET_PLUGINS_DIR}/<driver>)")
    dra.add_argument("--registry-dir", metavar="DIR", default=contract.KUBELET_REGISTRY_DIR,
                     help=f"kubelet plugin registration directory (default {contract.KUBELET_REGISTRY_DIR})")
    dra.add_argument("--metrics-port", type=int, default=9403, metavar="N",
                     help="Prometheus /metrics port, 0 to disable (default 9403)")

    ex = sub.add_parser("extender", help="run the kube-scheduler extender (HTTP)",
                        description="Serve kube-scheduler's extender protocol: /filter, /prioritize, /bind, "
                                    "plus /inspect, /healthz, /readyz and /metrics.")
    ex.add_argument("--listen", default="0.0.0.0:8888", metavar="HOST:PORT", help="address (default 0.0.0.0:8888)")
    ex.add_argument("--kubeconfig", metavar="FILE", default=os.environ.get("KUBECONFIG"),
                    help="kubeconfig (default: in-cluster service account)")
    ex.add_argument("--config", metavar="FILE", default=os.environ.get("VRAMSHARE_CONFIG"),
                    help="versioned config YAML (version: v1)")
    ex.add_argument("--policy", choices=["fgd", "binpack", "spread"],
                    help="placement policy (overrides the config; pods may override with an annotation)")
    ex.add_argument("--tls-cert", metavar="PEM", help="serving certificate chain (with --tls-key and --client-ca)")
    ex.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    ex.add_argument("--client-ca", metavar="PEM", help="CA whose client certificates may call the verbs and "
                    "/inspect (kube-scheduler's tlsConfig certFile); probes need none")
    ex.add_argument("--leader-elect", action="store_true",
                    help="run as one of several replicas: elect a leader over the Lease vramshare-extender in "
                         "$POD_NAMESPACE (identity $POD_NAME); a standby hands the verbs to the leader")
    ex.add_argument("--advertise-url", metavar="URL",
                    help="where this replica's verbs answer, for the others (default https://$POD_IP:<port>)")
    ex.add_argument("--peer-cert", metavar="PEM", help="client certificate a standby calls the leader with "
                    "(one the client CA trusts: the scheduler's, Secret vramshare-scheduler-tls)")
    ex.add_argument("--peer-key", metavar="PEM", help="key of --peer-cert")
    ex.add_argument("--metrics-listen", metavar="HOST:PORT",
                    help="plain-HTTP listener for /metrics, /healthz and /readyz only (for Prometheus)")

    sim = sub.add_parser("simulate", help="replay a cluster trace through the placement policies",
                         description="Replay the Alibaba GPU-sharing trace (openb) through the extender's "
                                     "own filter, score and GPU-pick code and report GPU allocation and "
                                     "fragmentation as the arrived workload grows to 130% of capacity.")
    sim.add_argument("--nodes", metavar="CSV", default=traces.find(traces.OPENB_NODES),
                     help=f"node list CSV (default: {traces.OPENB_NODES} under ${traces.ENV}, a checkout's "
                          "../shared/traces or the folder 'vramshare traces download' fills)")
    sim.add_argument("--pods", metavar="CSV", default=traces.find(traces.openb_pods()),
                     help=f"pod list CSV (default: {traces.openb_pods()}, found as --nodes is)")
    sim.add_argument("--policy", action="append", metavar="P",
                     help="policy to run; repeat for several (default: all). Ours: fgd, binpack, spread; "
                          "baselines: random, bestfit, gpupacking, dotprod, fgd-paper")
    sim.add_argument("--seeds", type=int, default=1, metavar="N", help="random seeds per policy (default 1)")
    sim.add_argument("--view", choices=["share", "memory"], default="share",
                     help="share: every GPU is 1000 units (the paper); memory: MiB per GPU model")
    sim.add_argument("--order", choices=["shuffle", "trace"], default="shuffle",
                     help="arrival order: shuffle per seed as the paper's runs do (default), or trace file order")
    from vramshare_cli.install import deploy_dir  # the manifests the package carries, wherever it runs from

    sim.add_argument("--as-scheduler", metavar="SCHEDULER_CONFIG", nargs="?",
                     const=str(deploy_dir() / "daemonset" / "scheduler-config.yaml"),
                     help="place as kube-scheduler with the extender would (in-tree Fit, default scores, the "
                          "extender's 0..10 times its weight from this KubeSchedulerConfiguration; default "
                          "deploy/daemonset/scheduler-config.yaml); pods asking no GPU by kube-scheduler alone")
    sim.add_argument("--out", metavar="DIR", default="bench/results/simulate",
                     help="where to write summary.json, the markdown table and the plot "
                          "(default bench/results/simulate)")

    demo = sub.add_parser("demo", help="run everything on loopback with simulated GPUs",
                          description="Start an API server stand-in, a simulated GPU node with the device "
                                      "plugin and a fake kubelet, and the extender; submit inference pods; "
                                      "show where each landed and why. Ends by itself.")
    demo.add_argument("--pods", type=int, metavar="N",
                      help=f"pods to submit, 1 to {DEMO_PODS} (default all {DEMO_PODS}; the DRA demo has fewer)")
    demo.add_argument("--verbose", action="store_true", help="also show every component's log lines")
    demo.add_argument("--quota", action="store_true", help="only the quota loop on one shared GPU (a few seconds)")
    demo.add_argument("--classes", metavar="CONFIG",
                      help="with --quota: a v1 config file whose quota keys and quota.classes the loop uses, on a "
                           "busier day (the three tenants ask more than the GPU holds at midday); tenants: "
                           "prod/chat-llama3 (priorityClassName inference-critical), batch/job-summarizer "
                           "(label team=eval), inference/rag-retriever (annotation quota-class: burst)")
    demo.add_argument("--dra", action="store_true",
                      help="the DRA path instead (Kubernetes 1.36+): DRA plugins, ResourceClaims, a stand-in "
                           "for kube-scheduler's DRA allocator and the kubelet's DRA manager")
    demo.add_argument("--mig", action="store_true",
                      help="dynamic MIG on the device-plugin path: the extender plans a partition, the device "
                           "plugin makes it at Allocate and destroys it when the pod is gone")

    inst = sub.add_parser("install", help="print every manifest an install needs: | kubectl apply -f -")
    from vramshare_cli import check_cmd, install
    install.add_arguments(inst)

    chk = sub.add_parser("check", help="check a cluster before or after installing (✓ / ✗ with the fix)",
                         description="Before (--pre) or after an install: the API server and its version, "
                                     "admission policies, the node-name claim, DRA (--dra), each GPU node's "
                                     "device plugin and enforcement mode, the extender (ready, reachable, "
                                     "certificates), the scheduler profile, the ConfigMap as the daemons read it "
                                     "(nodes that refused it, nodes still on an earlier text, keys waiting for a "
                                     "restart), pods refused by our admission policies. "
                                     "With --config FILE: a config file before you apply it (offline; --diff: "
                                     "against the cluster's, each change live or at which restart). One line "
                                     "each; exit status 1 when any is ✗.")
    check_cmd.add_arguments(chk)

    tr = sub.add_parser("traces", help="download the public traces, or show where they are found",
                        description=f"The traces 'simulate' and the benchmarks replay (Alibaba's openb and GenAI "
                                    f"traces, ServeGen) live in one folder: ${traces.ENV}, else a checkout's "
                                    f"../shared/traces, else {traces.download_dir({})}.")
    tr.add_argument("action", choices=["download", "where"],
                    help="download: fetch them (needs the internet); where: show which files are found")
    tr.add_argument("--dest", metavar="DIR", help=f"folder to fill (default ${traces.ENV}, else the cache folder)")
    tr.add_argument("--mirror", metavar="URL", help="fetch URL/<host>/<path> instead of https://<host>/<path>")

    insp = sub.add_parser("inspect", help="show per-GPU usage from a running extender",
                          description="Fetch /inspect from the extender and print total, used and free "
                                      "memory and the pods of every GPU. By default through the API server's "
                                      "service proxy with your kubeconfig (RBAC: get services/proxy on "
                                      "vramshare-extender); also 'kubectl vramshare inspect'.")
    insp.add_argument("node", nargs="?", help="one node (default: the whole cluster)")
    insp.add_argument("--namespace", default="vramshare-system", metavar="NS",
                      help="where vramshare runs (default vramshare-system)")
    insp.add_argument("--service", default="vramshare-extender", metavar="NAME",
                      help="the extender's Service (default vramshare-extender)")
    insp.add_argument("--kubeconfig", metavar="FILE", default=os.environ.get("KUBECONFIG"),
                      help="kubeconfig (default $KUBECONFIG, ~/.kube/config)")
    insp.add_argument("--extender", metavar="URL",
                      help="reach the extender directly instead: http://127.0.0.1:9402 after 'kubectl -n "
                           "vramshare-system port-forward svc/vramshare-extender 9402', or its https port with "
                           "--cacert/--cert/--key")
    insp.add_argument("--cacert", metavar="PEM", help="CA of the extender's serving certificate (https)")
    insp.add_argument("--cert", metavar="PEM", help="client certificate the extender trusts (https)")
    insp.add_argument("--key", metavar="PEM", help="key of --cert")
    return parser


_COMMANDS = {
    "device-plugin": "deviceplugin.kubelet.main",
    "dra-plugin": "deviceplugin.dra.main",
    "extender": "extender.main",
    "simulate": "extender.simulation.main",
    "demo": "standins.demo",
    "inspect": "extender.inspection",
    "traces": "vramshare_cli.traces_download",
    "install": "vramshare_cli.install",
    "check": "vramshare_cli.check_cmd",
}


def refuse_flags_that_do_not_apply(args: argparse.Namespace) -> None:
    """A flag the chosen mode ignores is refused, never silently dropped."""
    if args.command == "demo":
        if args.classes is not None and not args.quota:
            raise UsageError("--classes applies only to the quota demo: run 'vramshare demo --quota --classes FILE'")
        if args.quota and args.dra:
            raise UsageError("--quota and --dra are two different demos: run 'vramshare demo --quota' or "
                             "'vramshare demo --dra'")
        if getattr(args, "mig", False) and (args.quota or args.dra):
            raise UsageError("--mig is its own demo: run 'vramshare demo --mig' without --quota or --dra")
        if args.quota and args.pods is not None:
            raise UsageError("--pods does not apply to the quota demo (three tenants on one GPU): drop --pods")
        if args.pods is not None and args.pods < 1:
            raise UsageError(f"--pods {args.pods}: submit at least 1 pod")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        refuse_flags_that_do_not_apply(args)
        logs.setup(args.log_level, args.log_json)
        module = importlib.import_module(_COMMANDS[args.command])
        return int(module.run(args) or 0)
    except UsageError as exc:
        print(f"vramshare {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return 2
    except BrokenPipeError:
        # The reader went away (`vramshare demo | head`): stop quietly. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again (Python docs, signal module, "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)


if __name__ == "__main__":
    sys.exit(main())

"""The GPUs a pod takes on a node where pods of its size are held: the held plan, if it still fits.

:mod:`extender.holds` lets same-size pods be assumed together on a node only on the same GPUs. So when a
pod's size is held on the node kube-scheduler chose, the binder does not ask the policy where to put it:
it gives each held element's containers the held plan's GPUs (the policy still chooses for elements
nobody holds), checks that the result really has the held plans and fits what is free, and otherwise
refuses the node (the pod waits, as for any hold). Filter asks the same question, so a node passes only
where the bind will succeed. Pure: reads the ClusterState, changes nothing.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

from extender import cluster, holds, translate
from vramshare import contract, inventory, podspec
from vramshare.contract import assignment

__all__ = ["Choice", "follow", "containers_of", "FollowMemo", "template"]

Picks = list[list[tuple[str, int]]]


@dataclass(frozen=True)
class Choice:
    """The assignment text to write, what it holds per GPU, and its plans (for the pod's own hold)."""

    text: str
    allocations: list[tuple[str, int]]
    plans: dict[holds.Element, holds.Plan | None]


def containers_of(text: str) -> dict[str, list[tuple[str, int]]]:
    """The assignment annotation the binder just encoded, as container -> [(uuid, MiB)]."""
    return {c: [(g.uuid, g.mib) for g in gpus] for c, gpus in assignment.parse(text).items()}


def follow(state: cluster.ClusterState, node: str, pod: Mapping[str, Any], want: podspec.PodDemand,
           asks: Sequence[translate.ContainerAsk], names: contract.Names, need: Mapping[holds.Element, holds.Plan],
           free_picks: Callable[[], Picks]) -> Choice | str:
    """The pod placed on ``node`` with the held plans ``need``; a reason (str) when it cannot be.

    ``free_picks`` is the policy's choice (``placement.pick``) for asks nobody holds; called only if
    some ask is not held, and may raise ``cluster.NoFit``."""
    row = state.row(node)
    if row is None:
        return f"node {node} is not known"
    slots = {s.uuid: s for s in state.slots(row)}
    by_name = {c.container: c for c in (*want.init_containers, *want.containers)}
    picks: Picks = []
    policy_picks: Picks | None = None
    for i, ask in enumerate(asks):
        d = ask.demand
        c = by_name.get(ask.container)
        element = translate.container_signature(c, names).get(d.kind) if c is not None else None
        plan = need.get(element) if element is not None else None
        if plan is None:
            if policy_picks is None:
                try:
                    policy_picks = free_picks()
                except cluster.NoFit as exc:
                    return str(exc)
            picks.append(policy_picks[i])
            continue
        mine = [u for u, _ in plan if u in slots and slots[u].kind == d.kind]
        if len(mine) != d.count:
            return (f"the held plan has {len(mine)} GPU(s) of kind {d.kind} where container {ask.container} "
                    f"needs {d.count}")
        picks.append([(u, d.per_gpu if d.kind == translate.SHARED else slots[u].capacity) for u in mine])
    text = translate.encode_assignment(list(asks), picks)
    containers = containers_of(text)
    plans = holds.plans_of(want, names, containers)
    for e, plan in need.items():
        if plans.get(e) != plan:
            return f"its containers asking {e[1]} x {e[0]} would not all get the held GPUs"
    allocations = translate.Assignment(containers).allocations(pod)
    used = dict(zip(slots, state.used[row].tolist()))  # the row's usage per slot, as node_usage says it
    for uuid, mib in allocations:
        s = slots.get(uuid)
        if s is None or not s.healthy:
            return f"GPU {uuid} of the held plan is not a healthy GPU of {node}"
        if not inventory.model_matches(s.model, want.models):
            return f"GPU {uuid} of the held plan is a {s.model}, not one of {', '.join(want.models)}"
        if used[uuid] + mib > s.capacity:
            return f"GPU {s.index} ({uuid}) of the held plan has {s.capacity - used[uuid]} MiB free, needs {mib}"
    return Choice(text, allocations, plans)


def template(pod: Mapping[str, Any], want: podspec.PodDemand, asks: Sequence[translate.ContainerAsk],
             demands: Sequence[cluster.Demand], policy: str, host: cluster.HostDemand) -> Hashable:
    """Everything of a pod that :func:`follow` (and filter's ``free_picks``) reads, without who the pod
    is: the replicas of one Deployment share it. The demand without namespace, name and UID; the asks
    and demands; the policy and host demand ``free_picks`` places with; and what
    :meth:`translate.Assignment.allocations` reads of the spec (container names, init containers'
    names and restart policy, whether an overhead is declared)."""
    spec = pod.get("spec") or {}
    return (dataclasses.replace(want, namespace="", name="", uid=""), tuple(asks), tuple(demands), policy, host,
            tuple(c.get("name") for c in spec.get("containers") or ()),
            tuple((c.get("name"), c.get("restartPolicy")) for c in spec.get("initContainers") or ()),
            bool(spec.get("overhead")))


class FollowMemo:
    """:func:`follow`'s answers, kept while nothing they read changes, so the replicas of a burst that
    filter walks over the same held nodes do not place themselves again on each (filter's largest
    cost once holds are live).

    Keyed by node, its row, the row's ``row_version`` (bumped by every write to the row's slots, usage
    or host), ``names_epoch`` (a row changing hands), the held plans and the pod's :func:`template`.
    An answer that asked ``free_picks`` (the policy's choice for asks nobody holds, which may read
    more than the row) is kept only for the books' exact ``version``. Pinned to one ClusterState
    and one Names;
    bounded, least recently used dropped. Not thread-safe: used under the accounting lock."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._entries: OrderedDict[Hashable, tuple[int | None, Choice | str]] = OrderedDict()
        self._templates: dict[Hashable, int] = {}  # pod template -> a small id, so a key hashes cheaply
        self._state: cluster.ClusterState | None = None
        self._names: contract.Names | None = None
        self._max = max_entries
        self.hits = 0
        self.misses = 0

    def intern(self, pod_template: Hashable) -> int:
        """The id of a pod's :func:`template` (hashed once per request, not once per held node)."""
        if len(self._templates) >= self._max:
            self._templates.clear()
            self._entries.clear()
        return self._templates.setdefault(pod_template, len(self._templates))

    def follow(self, state: cluster.ClusterState, node: str, pod: Mapping[str, Any], want: podspec.PodDemand,
               asks: Sequence[translate.ContainerAsk], names: contract.Names,
               need: Mapping[holds.Element, holds.Plan], free_picks: Callable[[], Picks],
               pod_template: int) -> Choice | str:
        """:func:`follow`, answered from the memo when the same question was asked since the row last
        changed. ``pod_template`` is :meth:`intern` of the pod's :func:`template` (once per request)."""
        if state is not self._state or names is not self._names:
            self._entries.clear()  # template ids stay: they name pod templates, not answers
            self._state, self._names = state, names
        row = state.row(node)
        if row is None:
            return follow(state, node, pod, want, asks, names, need, free_picks)
        key = (node, row, int(state.row_version[row]), state.names_epoch, tuple(sorted(need.items())),
               pod_template)
        hit = self._entries.get(key)
        if hit is not None and (hit[0] is None or hit[0] == state.version):
            self.hits += 1
            self._entries.move_to_end(key)
            return hit[1]
        self.misses += 1
        asked = False

        def picks() -> Picks:
            nonlocal asked
            asked = True
            return free_picks()

        out = follow(state, node, pod, want, asks, names, need, picks)
        self._entries[key] = (state.version if asked else None, out)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return out

"""The GPUs a pod takes on a node where pods of its size are held: the held plan, if it still fits.

:mod:`extender.holds` lets same-size pods be assumed together on a node only on the same GPUs. So when a
pod's size is held on the node kube-scheduler chose, the binder does not ask the policy where to put it:
it gives each held element's containers the held plan's GPUs (the policy still chooses for elements
nobody holds), checks that the result really has the held plans and fits what is free, and otherwise
refuses the node (the pod waits, as for any hold). Filter asks the same question, so a node passes only
where the bind will succeed. Pure: reads the ClusterState, changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from extender import cluster, holds, translate
from vramshare import contract, inventory, podspec
from vramshare.contract import assignment

__all__ = ["Choice", "follow", "containers_of"]

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
    used = {u.slot.uuid: u.used for u in state.node_usage(node)}
    for uuid, mib in allocations:
        s = slots.get(uuid)
        if s is None or not s.healthy:
            return f"GPU {uuid} of the held plan is not a healthy GPU of {node}"
        if not inventory.model_matches(s.model, want.models):
            return f"GPU {uuid} of the held plan is a {s.model}, not one of {', '.join(want.models)}"
        if used[uuid] + mib > s.capacity:
            return f"GPU {s.index} ({uuid}) of the held plan has {s.capacity - used[uuid]} MiB free, needs {mib}"
    return Choice(text, allocations, plans)

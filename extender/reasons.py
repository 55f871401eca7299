"""Why a pod does not fit a node, in words a person can act on.

Two audiences. ``why_not`` answers for one node (a refused bind, a pick): it names that node's numbers,
the largest free amount and on which GPU. Filter's reasons (``why_not_many``/``why_not_rows``) go to
kube-scheduler, which counts identical strings over every node (``FitError.Error``: "0/5000 nodes are
available: 4990 <reason>, 10 <reason>.") into the pod's PodScheduled condition, and the first 1,024 bytes
into its FailedScheduling event: so they name only what every node shares (the ask, the kind, the
model), never a node's own free amount, or 5,000 nodes would write 5,000 entries; :func:`with_best`
then adds the one number worth reading to all of them alike, the most free on any of those nodes.
Only computed for nodes that failed. Pure, no I/O.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from extender.cluster import EXCLUSIVE, MIG_FIT, MIG_PREFIX, SHARED, Demand
from extender.fit import Ask
from vramshare import contract


@lru_cache(maxsize=4096)
def mib(amount: int) -> str:
    """``20480`` -> ``20 GiB``; ``1536`` -> ``1.5 GiB``; below 1 GiB in MiB."""
    if amount >= 1024:
        gib = amount / 1024
        return f"{gib:.0f} GiB" if gib == int(gib) else f"{gib:.1f} GiB"
    return f"{amount} MiB"


def _kind_words(d: Demand) -> str:
    if d.kind == SHARED:
        return "GPU in shared mode"
    if d.kind == EXCLUSIVE:
        return "whole GPU (exclusive mode)"
    if d.kind == MIG_FIT:
        return f"MIG partition for {mib(d.per_gpu)} (isolation: mig)"
    return f"MIG instance of profile {d.kind[len(MIG_PREFIX):]}"


#: the annotation that spreads a request over several GPUs, named in the reason for a request no GPU holds
_GPU_COUNT = contract.Names().gpu_count


def _too_big(per_gpu: int, k: int, largest: int, gpu: int | None) -> str | None:
    """The reason when no usable GPU holds ``per_gpu`` MiB even empty (no wait or eviction helps: the user
    must ask less or spread the request over more GPUs), else None. ``gpu``: which one is the largest,
    for one node's answer (filter's leave it out: kube-scheduler counts identical reasons)."""
    if largest >= per_gpu:
        return None
    each, more = (" each", " per GPU") if k > 1 else ("", "")
    which = f", GPU {gpu}," if gpu is not None else ""
    return (f"no GPU here holds {mib(per_gpu)}{each} (the largest{which} holds {mib(largest)}): ask at most "
            f"{mib(largest)}{more}, or split the request over {'more' if k > 1 else 'several'} GPUs with the "
            f"annotation {_GPU_COUNT}")


def _alone(ask: Ask, j: int, i: int, detail: bool = True) -> str | None:
    """Reason demand ``i`` alone cannot fit row ``j``, or None when it can (``detail``: with the row's
    own free amounts, for one node's answer; without, for filter's, which kube-scheduler counts)."""
    st, d = ask.state, ask.demands[i]
    row = int(ask.rows[j])
    index = st.index[row]
    of_kind = st.kind_mask(d, np.array([row]))[0]
    if not of_kind.any():
        if d.kind == MIG_FIT:
            return _no_fit_profile(ask, row, d)
        return f"node has no {_kind_words(d)}"
    allowed = of_kind
    if d.models:
        allowed = of_kind & st.model_mask(d.models)[st.model[row]]
        if not allowed.any():
            return f"no GPU matches models {'|'.join(d.models)}"
    usable = ask.mask(i)[j]
    if not usable.any():
        return f"all {int(allowed.sum())} matching GPUs are unhealthy"
    free = np.where(usable, ask.free[j], -1)
    k = max(1, d.count)
    if d.kind == SHARED:
        having = int((free >= d.per_gpu).sum())
        if having >= k:
            return None
        cap = np.where(usable, ask.capacity[j], -1)
        g = int(np.argmax(cap))
        too_big = _too_big(d.per_gpu, k, int(cap[g]), int(index[g]) if detail else None)
        if too_big is not None:
            return too_big
        if k == 1:
            if not detail:
                return room_reason(d.per_gpu)
            g = int(np.argmax(free))
            return (f"no GPU has {mib(d.per_gpu)} free; largest free is {mib(int(free[g]))} "
                    f"on GPU {int(index[g])}")
        return f"needs {k} GPUs with {mib(d.per_gpu)} free each; only {having} {'has' if having == 1 else 'have'}"
    whole = int((usable & (ask.free[j] == ask.capacity[j]) & (ask.capacity[j] > 0)).sum())
    if whole >= k:
        return None
    if d.kind == EXCLUSIVE:
        return f"needs {k} free whole GPU{'s' if k > 1 else ''}; {whole} of {int(usable.sum())} free"
    if d.kind == MIG_FIT:
        return f"no free MIG placement of the smallest profile holding {mib(d.per_gpu)} (isolation: mig)"
    profile = d.kind[len(MIG_PREFIX):]
    if k == 1:
        return f"no free MIG instance of profile {profile}"
    return f"needs {k} free MIG instances of profile {profile}; only {whole} free"


def _no_fit_profile(ask: Ask, row: int, d: Demand) -> str:
    """Why an ``isolation: mig`` ask has no placement kind at all on this node."""
    geo = ask.state.mig_geometry(ask.state.name(row))
    if not geo:
        return f"node has no GPU with dynamic MIG for a {_kind_words(d)}"
    if not any(g.isolation for g in geo.values()):
        return ("the node's device plugin does not serve isolation: mig (it needs the pod cache, and a "
                "version that offers MIG GPUs' memory units)")
    largest = max(p.memory_mib for g in geo.values() for p in g.table.profiles if not p.media)
    return (f"no MIG profile holds {mib(d.per_gpu)} (isolation: mig); the largest on this node is "
            f"{mib(largest)}")


def room_reason(per_gpu: int) -> str:
    """Filter's reason for a node where no GPU has room for a one-GPU ask (the same on every node)."""
    return f"no GPU has {mib(per_gpu)} free"


def why_not(ask: Ask, j: int, detail: bool = True) -> str:
    """The first reason the pod cannot go to ``ask.rows[j]`` (``detail``: see :func:`_alone`)."""
    h = ask.host
    if ask.cpu_free[j] < h.cpu_milli:
        return f"insufficient cpu: needs {h.cpu_milli}m" + (f", {int(ask.cpu_free[j])}m free" if detail else "")
    if ask.mem_free[j] < h.memory_mib:
        return (f"insufficient memory: needs {mib(h.memory_mib)}"
                + (f", {mib(int(ask.mem_free[j]))} free" if detail else ""))
    for i in range(len(ask.demands)):
        reason = _alone(ask, j, i, detail)
        if reason is not None:
            return reason if len(ask.demands) == 1 else f"container {i + 1}: {reason}"
    total = sum(d.per_gpu * d.count for d in ask.demands if d.kind == SHARED)
    free = int(np.where(ask.shared[j], ask.free[j], 0).sum())
    return (f"each container fits alone but not all {len(ask.demands)} together "
            f"({mib(total)} shared GPU memory asked" + (f", {mib(free)} free on this node)" if detail else ")"))


#: What the reasons memo depends on besides each row's version: nothing global (a reason reads its row,
#: the demands and the host demand alone), so one constant pin.
_PIN = object()


def why_not_rows(ask: Ask, failing: np.ndarray) -> list[str]:
    """:func:`why_not_many`, kept per row until the row changes (``row_version``): kube-scheduler asks
    about the same few pod shapes cycle after cycle while a bind changes one row, so the reasons of
    the other failed rows are the same strings again. Keyed by the demands and the host demand, which
    with the row are everything a reason reads."""
    if not len(failing):
        return []
    st, rows = ask.state, ask.rows[failing]

    def compute(stale: np.ndarray) -> np.ndarray:
        # on an Ask of the stale rows alone: ``ask``'s own views span every candidate ([n, G] copies)
        sub = Ask(st, ask.demands, rows[stale], ask.host)
        return np.array(why_not_many(sub, np.arange(len(sub.rows))), dtype=object)

    return st.memo.get(("why not", ask.demands, ask.host), _PIN, rows, st.row_version, compute).tolist()


def why_not_many(ask: Ask, failing: np.ndarray) -> list[str]:
    """Reasons for many rows at once; the common one-shared-demand case is vectorised.

    A 5,000-node cluster where most nodes are full must not spend milliseconds formatting messages.
    """
    d = ask.demands
    if len(d) != 1 or d[0].kind != SHARED or len(failing) == 0:
        return [why_not(ask, int(j), detail=False) for j in failing]
    r, k = d[0].per_gpu, max(1, d[0].count)
    usable = ask.mask(0)[failing]
    free = np.where(usable, ask.free[failing], -1)
    having = (free >= r).sum(axis=1)
    host_short = (ask.cpu_free[failing] < ask.host.cpu_milli) | (ask.mem_free[failing] < ask.host.memory_mib)
    cap = np.where(usable, ask.capacity[failing], -1)
    simple = usable.any(axis=1) & ~host_short & (cap.max(axis=1) >= r)  # else: no GPU holds it (_alone)
    room = room_reason(r)
    out = []
    for j, ok, h in zip(failing.tolist(), simple.tolist(), having.tolist()):
        if not ok:
            out.append(why_not(ask, j, detail=False))
        elif k == 1:
            out.append(room)
        else:
            out.append(f"needs {k} GPUs with {mib(r)} free each; only {h} {'has' if h == 1 else 'have'}")
    return out


def with_best(ask: Ask, failing: np.ndarray, reasons: list[str]) -> list[str]:
    """Filter's reasons with the most free memory on any node that failed only for room, and where, added
    to that reason on every such node alike (kube-scheduler counts them as one: "4990 no GPU has 45 GiB
    free; the most free: 39.5 GiB on gpu-7, GPU 3"). Only for the one-GPU shared ask, whose shortfall is
    one number; ``reasons`` are ``failing``'s, in order."""
    d = ask.demands
    if len(d) != 1 or d[0].kind != SHARED or max(1, d[0].count) != 1 or not len(failing):
        return reasons
    room = room_reason(d[0].per_gpu)
    short = np.fromiter((r == room for r in reasons), bool, len(reasons))
    if not short.any():
        return reasons
    # on an Ask of those rows alone, as why_not_rows: ``ask``'s own views span every candidate ([n, G] copies)
    sub = Ask(ask.state, d, ask.rows[failing[short]], ask.host)
    free = np.where(sub.mask(0), sub.free, -1)
    j, col = divmod(int(np.argmax(free)), free.shape[1])
    row = int(sub.rows[j])
    best = (f"{room}; the most free: {mib(int(free[j, col]))} on {ask.state.name(row)}, "
            f"GPU {int(ask.state.index[row, col])}")
    return [best if s else r for r, s in zip(reasons, short.tolist())]

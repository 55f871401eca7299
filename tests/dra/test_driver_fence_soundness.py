"""A hostile randomized hunt on the DRA node's fences in driver mode (round 9's sum fences, unit-tested
only): claims named by 1-3 containers of a pod (init containers and sidecars by the kubelet's rule),
claims 2-3 pods share, pods that start and stop at random ticks or join a claim after its Prepare,
containers that restart (a new cgroup), uses that try to grow past every limit. The node is
tests/dra/driver_node.py: the real preparer, tenant source, quota loop, policy, writer and driver fence;
the fake NVML's per-cgroup limits at the GPU's edge. Checked after every tick, at node level:

1. per GPU, the sum over every live cgroup of the hard limit in force <= the GPU's capacity, and the sum
   of uses <= capacity;
2. a claim's containers together never hold (use, and hard limits in force) more than its grant, or what
   the loop lent it lately for a claim that is a tenant;
3. a tenant claim is not held below min(its grant, its containers' demand) while another claim borrows,
   for longer than the loop needs to react (three times that for a claim of several containers: the
   policy sees the claim's use, not each container's pressure). Per container the rule cannot hold, for
   tenant and shared claims alike: the driver never takes memory back, so the fence keeps what each
   sibling holds and splits only the rest (``fence.split_limit``): a container may sit below grant/n
   while a sibling holds more, until that sibling releases.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deviceplugin.quota.model import PolicyParams
from tests.dra.driver_node import CAP, GPU, Ctr, DriverDraNode, SimClaim, SimPod
from vramshare.inventory import EnforcementMode

GIB = 1024
TICKS = 40
EXAMPLES = int(os.environ.get("VRAMSHARE_HUNT_EXAMPLES", "60"))  # CI: ~5 s; the hunt ran thousands


@dataclass(frozen=True)
class Ranges:
    """What the generator draws from: CI's, or the hunt's wider ones (``VRAMSHARE_HUNT_WIDE=1``)."""

    ticks: int = TICKS
    claims: int = 3  # 1..claims claims
    pods: tuple[int, ...] = (1, 1, 2, 3)  # pods per claim
    restarts: int = 2  # per container, at most
    ack: int = 2  # acknowledgement lag, at most
    status: int = 1  # pod-cache lag, at most
    demand: tuple[int, int] = (3, 2)  # a container's demand: up to grant * 3 // 2
    headrooms: tuple[str, ...] = ("forecast", "peak")
    cache: int = 2  # ticks after its start before the pod cache lists the pod, at most
    linger: int = 2  # ticks a deleted pod's containers run on, at most


R = Ranges(60, 4, (1, 1, 2, 3, 4), 3, 3, 2, (2, 1), ("forecast", "peak", "learned"), 4, 4) \
    if os.environ.get("VRAMSHARE_HUNT_WIDE") == "1" else Ranges()
LEAD = 2 * R.ack + 2  # ticks from a later bind to the pod's start (2 x the largest acknowledgement lag + 2)


def walk(seed: int, top: int, ticks: int = TICKS) -> list[int]:
    """A demand walk between 0 and ``top`` (a seed pins one)."""
    rng = random.Random(seed)
    level, out = rng.randint(0, top), []
    for _ in range(ticks):
        level = max(0, min(top, level + rng.choice((-4096, -1024, 0, 0, 1024, 4096, 8192))))
        out.append(level)
    return out


@st.composite
def containers(draw, pod: str, grant: int) -> list[Ctr]:
    """1-3 containers naming the claim (app, init or sidecar, in any order), at least one app container,
    maybe a plain one; each demands up to 1.5 x the grant (hostile: more than any share of it)."""
    kinds = draw(st.lists(st.sampled_from(["app", "app", "init", "sidecar"]), min_size=1, max_size=3))
    if "app" not in kinds:
        kinds.append("app")
    if "sidecar" in kinds and "init" in kinds[kinds.index("sidecar"):]:
        event("an ordinary init container after a sidecar")  # drahunt's open case, closed by fence.split_slots
    top = grant * R.demand[0] // R.demand[1]
    out = []
    for i, kind in enumerate(kinds):
        restarts = () if kind == "init" else \
            tuple(sorted(set(draw(st.lists(st.integers(2, R.ticks), max_size=R.restarts)))))
        seed = draw(st.integers(0, 2 ** 16))
        out.append(Ctr(f"c{i}", kind, True, walk(seed, top, R.ticks), restarts, init_ticks=draw(st.integers(1, 3)),
                       label=f"walk({seed}, {top}, {R.ticks})"))
    if draw(st.booleans()):
        out.append(Ctr("plain", "app", False, [0], label="[0]"))
    return out


@st.composite
def nodes(draw, pending: bool = False) -> tuple[list[SimClaim], list[SimPod]]:
    """1-3 claims whose grants fit the GPU (the allocator's books), each used by 1 pod (a tenant) or 2-3
    pods (shared); pods bound and started at random ticks (a later one may join after Prepare), some
    deleted later; release modes, acknowledgement lags and pod-cache lags at random. With ``pending``, a
    pod the claim was prepared for may be pending for a while: listed by the pod cache only some ticks
    after its start, or dropped from it while its containers still run (deleted; the kubelet unprepares
    the claim some ticks after they all exited). Every property draws these (the driver fence finds such
    a pod's containers by its pod's cgroup). A pod that joined after Prepare is in no checkpoint: only the
    pod cache links its processes to the claim, so it is not drawn pending."""
    n = draw(st.integers(1, R.claims))
    left, claims, pods = CAP // GIB, [], []
    for i in range(n):
        grant = draw(st.integers(2, max(2, left // (n - i)))) * GIB
        left -= grant // GIB
        claims.append(SimClaim(f"k{i}", grant))
        first = draw(st.integers(0, 10))
        for j in range(draw(st.sampled_from(R.pods))):
            bind = first if j == 0 else draw(st.integers(first, first + 20))
            # as the device plugin's property (tests/quota/test_node_soundness.py nodes()): a pod bound beside
            # running ones starts after the loop could shrink a lender it was lent from (2 x the largest
            # acknowledgement lag + 2 ticks: image pull, model load); at tick 0 nobody has lent anything
            start = bind + draw(st.integers(0, 2)) + (LEAD if bind else 0)
            stop = draw(st.one_of(st.none(), st.integers(start + 3, R.ticks + 5)))
            pods.append(SimPod(f"p{i}{j}", f"k{i}", bind, start, stop, draw(containers(f"p{i}{j}", grant)),
                               mode=draw(st.sampled_from(["unmap", "unmap", "throttle"])),
                               ack_lag=draw(st.integers(0, R.ack)), status_lag=draw(st.integers(0, R.status))))
        mine = [p for p in pods if p.claim == f"k{i}"]
        prepared_at = min(p.start for p in mine)  # the kubelet prepares the claim for the pods bound by then
        if pending:
            claims[-1].unprepare_lag = draw(st.integers(0, R.linger))
        for p in mine:
            if pending and p.bind <= prepared_at:
                # the claim's first pod is listed from its bind (the loop counts its claim from then, before
                # Prepare: ``AllocatedClaims``, which reads the pod cache), unless it starts at tick 0, before
                # anything is lent: the LEAD premise above needs the loop to know the claim LEAD ticks before
                # its start (test_a_claim_whose_only_pod_the_cache_lists_after_its_start_is_lent_before_prepare)
                first_pod = p is mine[0] and p.start > 0
                p.cache_lag = 0 if first_pod else draw(st.sampled_from([0, 0] + list(range(1, R.cache + 1))))
                p.linger = draw(st.integers(0, R.linger)) if p.stop is not None else 0
                if p.cache_lag or p.linger:
                    event("a pod the claim was prepared for pending: " +
                          ("not listed yet" if p.cache_lag else "") + (" and " if p.cache_lag and p.linger else "") +
                          ("deleted, containers exiting" if p.linger else ""))
    return claims, pods


def run_and_check(node: DriverDraNode, ticks: int = TICKS, restart: int | None = None) -> None:
    react = 2 * max(p.ack_lag for p in node.pods) + 6
    short: dict[str, int] = {c.name: 0 for c in node.claims}
    for _ in range(ticks):
        if node.t == restart:
            node.restart_loop()
        node.step()
        t = node.t - 1
        live = [(p, c) for p in node.pods for c in node.live(p) if c.gpu]
        uses = {(p.name, c.name): node.use[(p.name, c.name)] for p, c in live}
        # a container the loop has not seen yet (its ID not in the pod's status) holds the limit the toolkit
        # set from its CDI spec, which no fence can move: its share made at Prepare (grant // the users
        # then). Where its claim was cut below that share (a restart while lending) or a pod joined it after
        # Prepare, the hard limits in force exceed what was promised until the loop's first tick that sees
        # it (test_a_pod_joining_late_holds_the_share_made_at_prepare_until_the_loop_sees_it). Its use is
        # checked all the same (an engine loads before it allocates; by then the kubelet posted the ID).
        # A claim that is no tenant is the exception: the fence finds the containers of the pods it was
        # prepared for by their pod's cgroup, listed or not, posted or not, from their first tick.
        tenants = {tn.key.container for tn in node.loop.tenants_now}
        window = {(p.name, c.name) for p, c in live if not node.visible(p, c, t)
                  and (f"claim-{p.claim}" in tenants or node.joined_late(p))}
        hards = {(p.name, c.name): node.hard(p, c) for p, c in live if (p.name, c.name) not in window}
        where = (t, sorted(uses.items()), sorted(hards.items()), {k: v[-3:] for k, v in node.lent.items()})
        # 1. the node's sums
        assert sum(uses.values()) <= CAP, ("uses", where)
        assert sum(hards.values()) <= CAP, ("hard limits", where)
        # 2. a claim's containers in sum
        for claim in node.claims:
            mine = [(p.name, c.name) for p, c in live if p.claim == claim.name]
            bound = max([claim.grant] + node.lent[claim.name][-react:])
            assert sum(uses[k] for k in mine) <= bound, ("claim uses", claim.name, bound, where)
            assert sum(hards.get(k, 0) for k in mine) <= bound, ("claim hard limits", claim.name, bound, where)
        # 3. fairness
        tenants_of = {tn.key.container: tn for tn in node.loop.tenants_now}
        borrowing = {c.name for c in node.claims
                     if sum(uses[(p.name, x.name)] for p, x in live if p.claim == c.name) > c.grant}
        for claim in node.claims:
            tn = tenants_of.get(f"claim-{claim.name}")
            mine = [(p, c) for p, c in live if p.claim == claim.name]
            if tn is None or not mine or node.quota_dir(claim.name) is None:
                short[claim.name] = 0
                continue
            demand = sum(c.demand_at(t) for _p, c in mine)
            cut = node.lent[claim.name][-1] < min(claim.grant, demand) and borrowing - {claim.name}
            short[claim.name] = short[claim.name] + 1 if cut else 0
            # several containers: the policy sees the claim's use, and a quiet sibling's share hides a busy
            # container's pressure for a tick at a time (it gets the rest at the next split); under overload
            # rule 4 covers a borrower's whole use before an owner's headroom, so the owner climbs back by
            # margins: a longer bound, not none (the hunt saw 8 ticks with react 6)
            slack = react if len(mine) == 1 else 3 * react
            assert short[claim.name] <= slack, ("held below its grant while another borrows", claim.name, where)
    assert node.loop.counts["node_overcommit"] == 0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nodes(pending=True), st.one_of(st.none(), st.integers(1, R.ticks - 1)), st.sampled_from(R.headrooms))
def test_driver_fences_hold_claims_in_sum_on_the_dra_node(tmp_path_factory, world, restart, headroom):
    claims, pods = world
    node = DriverDraNode(str(tmp_path_factory.mktemp("node")), claims, pods, PolicyParams(headroom=headroom))
    run_and_check(node, R.ticks, restart=restart)


# -- the counterexamples the hunt found, as examples (each fails on the branch's base, c5ed0ab, but the one
# -- marked otherwise; the rules whose examples stopped failing once the node grew faithful are unit-tested in
# -- tests/quota/test_driver_mode.py) ---------------------------------------------------------------------
def _flat(name: str, kind: str, mib: int, restarts: tuple[int, ...] = ()) -> Ctr:
    return Ctr(name, kind, True, [mib] * TICKS, restarts, init_ticks=1, label=f"[{mib}]")


def test_a_pod_joining_a_claim_after_its_prepare_does_not_take_the_grant_again(tmp_path):
    """The hunt's first case: a 10 GiB claim prepared for one pod (its CDI spec: the whole grant for its one
    container), lent up to 15 GiB while alone; a second pod reserves it a tick later. The kubelet does not
    prepare a prepared claim again (``prepareResources``), so the checkpoint still names one pod: on the
    base the claim stayed that pod's tenant, the joiner's container was no tenant's and no shared claim's,
    and ran at its spec's 10 GiB beside the first one's 15: 25,600 MiB on a 10,240 MiB claim."""
    claims = [SimClaim("k0", 10240), SimClaim("k1", 37888)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 13835)]),
            SimPod("p01", "k0", 1, 1, None, [_flat("c0", "app", 13835)]),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", 55340)])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=12)


def test_a_restarted_container_of_a_cut_tenant_is_fenced_at_its_share_again(tmp_path):
    """A container restarts (a new cgroup: the toolkit applies the CDI spec's share, the grant // n) while
    its claim is cut below its grant for a borrower: the loop must bring the new cgroup back to the claim's
    split at its next tick, not when the limit next changes."""
    claims = [SimClaim("k0", 20480), SimClaim("k1", 60416)]
    pods = [SimPod("p00", "k0", 0, 0, None, [Ctr("c0", "app", True, [1024] * 12 + [20480] * TICKS, (10,), label="low")]),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", 75000)])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=20)


def test_a_sidecar_naming_the_claim_is_fenced_with_the_app_in_sum(tmp_path):
    """A sidecar (an init container with restartPolicy Always) names the claim beside the app: the CDI
    spec gives each half the grant. The kubelet reports a sidecar's container ID in
    ``status.initContainerStatuses``, which the tenant source never read, so the loop never found its
    cgroup: it fenced the app as if the sidecar had not started and left the sidecar at the spec's half
    whatever the claim was cut to, while a borrower took the rest of the GPU."""
    claims = [SimClaim("k0", 20480), SimClaim("k1", 60416)]
    pods = [SimPod("p00", "k0", 0, 0, None, [Ctr("c0", "sidecar", True, [0] * 14 + [10240] * TICKS, label="late"),
                                            _flat("c1", "app", 1024)]),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", 75000)])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=24)


def test_a_pod_joining_a_claim_whose_first_pod_holds_the_grant_gets_only_what_is_left(tmp_path):
    """The hunt's case: a throttling engine holds its claim's whole 2 GiB; a second pod joins the claim.
    The loop held the two at half the grant each, but the driver takes back nothing the first holds:
    the joiner took its half on top, 3,072 MiB held on a 2,048 MiB claim. The split keeps what each holds."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", 2048)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 3072)]),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", 3072)], mode="throttle"),
            SimPod("p11", "k1", 1, 1, None, [_flat("c0", "app", 3072)])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=12)


def test_a_late_acknowledging_engine_s_hard_limit_is_what_the_loop_counts_it_at(tmp_path):
    """The hunt's case, on no DRA-specific rule: three claims, one engine acknowledging its quota files 2
    ticks late while the loop writes it a new one every tick. Its hard limit was lowered only once it had
    acknowledged the latest file, which it never caught up with, so it kept the highest it ever had
    (39,623 MiB) while the policy counted it at the most it might still follow (37,804) and lent the
    difference: 81,095 MiB of hard limits on 80,896."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", 26624), SimClaim("k2", 25600)]
    pods = [SimPod("p00", "k0", 0, 0, None, [Ctr("c0", "app", True, walk(0, 3072), label="walk(0, 3072)")]),
            SimPod("p10", "k1", 0, 0, None, [Ctr("c0", "app", True, walk(0, 39936), label="walk(0, 39936)")],
                   ack_lag=2),
            SimPod("p20", "k2", 0, 0, None, [Ctr("c0", "app", True, walk(1, 38400), label="walk(1, 38400)")])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods))


def test_an_engine_first_reporting_an_older_file_is_not_counted_above_its_hard_limit(tmp_path):
    """(Passes on the base; fails on this branch's first fix of the late-acknowledging engine, which set
    the hard limit at the most the engine may still grow to, without this cap.) The hunt's case: an engine whose /metrics answers 2 ticks late was shrunk 41,472 -> 40,960 before
    it reported any generation (so the driver enforced the shrink at once); its first report named the
    older 41,472 file, and the loop then counted it at up to 41,472 again, raised it back into that "for
    free" while a newcomer held the rest: 81,408 MiB of hard limits on 80,896. The driver enforces
    40,960 whatever file it follows: that is the most it may hold."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", 27648), SimClaim("k2", 24576)]
    pods = [SimPod("p00", "k0", 0, 0, None, [Ctr("c0", "app", True, walk(0, 3072), label="walk(0, 3072)")]),
            SimPod("p10", "k1", 0, 0, None, [Ctr("c0", "app", True, walk(1, 41472), label="walk(1, 41472)")],
                   ack_lag=2),
            SimPod("p20", "k2", 0, 1, None, [Ctr("c0", "app", True, walk(0, 36864), label="walk(0, 36864)")])]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods))


def _w(name: str, kind: str, seed: int, top: int, restarts: tuple[int, ...] = (), init_ticks: int = 1) -> Ctr:
    return Ctr(name, kind, True, walk(seed, top), restarts, init_ticks=init_ticks, label=f"walk({seed}, {top})")


def test_a_shared_claim_s_memory_is_counted_once(tmp_path):
    """The hunt's case: a 31 GiB claim two pods share, its containers holding their grant. The driver
    fence read their memory as foreign (no tenant cgroup holds it) and the loop counted the claim at its
    grant on top: 31,744 MiB counted twice, the tenants squeezed into the 17,408 left (a 35 GiB claim cut
    to 17,408 MiB, a 2 GiB one to 0) and the loop's own node check broken. Within its grant a held claim's
    memory is the claim's, counted once."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", 35840), SimClaim("k2", 31744)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_w("c0", "app", 0, 3072)]),
            SimPod("p10", "k1", 0, 0, None, [_w("c0", "app", 0, 53760, (2,)), _w("c1", "init", 0, 53760)],
                   status_lag=1),
            SimPod("p20", "k2", 0, 0, None, [_w("c0", "app", 0, 47616)]),
            SimPod("p21", "k2", 0, 0, None, [_w("c0", "app", 0, 47616)])]
    node = DriverDraNode(str(tmp_path), claims, pods)
    run_and_check(node, ticks=16)
    assert node.loop.capacities[GPU] == CAP


def test_a_sidecar_grown_into_an_init_container_s_part_leaves_no_room_for_the_app(tmp_path):
    """The drahunt's last counterexample (fails on deb8676, where it was a strict xfail). A 45 GiB claim of
    a sidecar, an init container and the app (two run at once: 22,5 GiB each in the CDI spec), lent up to
    67 GiB. While the sidecar and the init container ran, the split gave the busy sidecar the rest (up to
    68,608 MiB; it held 54,590); the init container ended and the app started at its spec's 23,040 on top:
    77,630 MiB on a 68,608 limit, 81,408 of hard limits on the GPU. The split (``fence.split_slots``) keeps
    the share of the container that follows an ordinary init container: the sidecar may grow to the limit
    less that share, and the app's start fits."""
    claims = [SimClaim("k0", 6144), SimClaim("k1", 2048), SimClaim("k2", 46080)]
    pods = [SimPod("p00", "k0", 1, 8, None, [_w("c0", "app", 52, 9216)], ack_lag=2),
            SimPod("p10", "k1", 0, 0, None, [_w("c0", "app", 0, 3072)]),
            SimPod("p20", "k2", 1, 8, None, [_w("c0", "init", 0, 69120), _w("c1", "sidecar", 0, 69120),
                                            _w("c2", "init", 0, 69120, init_ticks=2), _w("c3", "app", 0, 69120)],
                   ack_lag=2, status_lag=1)]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=20)


# -- MPS mode: the same split at Prepare, fixed at each client's start (nothing moves it afterwards) ----------
@settings(max_examples=max(5, EXAMPLES // 3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nodes(pending=True))
def test_in_mps_mode_a_claim_s_clients_hold_at_most_its_grant(tmp_path_factory, world):
    """MPS mode: each container of a claim is an MPS client pinned at its CDI share
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` = grant // users at Prepare), restarts and init containers
    included, so together they hold at most the grant, and the node at most the GPU. A pod that joins a
    claim after Prepare is the exception (next test): its clients get the share made for the pods then."""
    claims, pods = world
    node = DriverDraNode(str(tmp_path_factory.mktemp("mps")), claims, pods, mode=EnforcementMode.MPS)
    for _ in range(R.ticks):
        node.step()
        live = [(p, c) for p in node.pods for c in node.live(p) if c.gpu and not node.joined_late(p)]
        assert sum(node.hard(p, c) for p, c in live) <= CAP
        for claim in node.claims:
            assert sum(node.hard(p, c) for p, c in live if p.claim == claim.name) <= claim.grant


def test_a_pod_joining_late_holds_the_share_made_at_prepare_until_the_loop_sees_it(tmp_path):
    """What no fence closes (pinned here so a change shows): the kubelet prepares a claim once, so a pod
    that reserves it later starts with the CDI share made for the pods reserved at Prepare. In driver mode
    the loop holds the claim at its grant in sum from its first tick that shows the joiner's container IDs
    (here the pod cache shows them a tick late: one tick over); in MPS mode a client's limit is fixed at its
    start, so the pair keeps twice the grant for as long as both run."""
    def world():
        return [SimClaim("k0", 8192)], [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 8192)]),
                                        SimPod("p01", "k0", 3, 3, None, [_flat("c0", "app", 8192)], status_lag=1)]
    claims, pods = world()
    node = DriverDraNode(str(tmp_path / "driver"), claims, pods)
    sums = []
    for _ in range(8):
        node.step()
        sums.append(sum(node.hard(p, c) for p in pods for c in node.live(p)))
    assert sums[:3] == [12288] * 3, sums  # alone: a tenant, lent up to 1.5 x its grant
    # joined: the joiner at the 8,192 its CDI spec gives it (Prepare's share: one user then), and the fence
    # keeps that share for it while its container is not found, so the first may hold nothing more (hard 0
    # while it holds its 8,192; before the sharers came from Prepare's count, 4,096 + 8,192)
    assert sums[3] == 0 + 8192, sums
    assert all(s <= 8192 for s in sums[4:]), sums  # seen: the grant in sum
    claims, pods = world()
    node = DriverDraNode(str(tmp_path / "mps"), claims, pods, mode=EnforcementMode.MPS)
    for _ in range(8):
        node.step()
    assert sum(node.hard(p, c) for p in pods for c in node.live(p)) == 2 * 8192


# -- cooperative mode: nothing fences, the loop reads use from NVML's processes -------------------------------
def test_in_cooperative_mode_a_shared_claim_s_memory_is_counted_once(tmp_path):
    """Fault 8 of the drahunt (a shared claim's memory counted twice: as foreign, in no tenant's
    container, and at its grant as a pending claim) on the cooperative path: NVML's processes of the two
    pods sharing a 31 GiB claim matched no tenant, so the loop took them off the GPU's capacity and
    counted the claim at its grant on top, and the tenants were squeezed into what was left (the 35 GiB
    claim of a tenant cut below its grant while it used it all). Within its grant, a shared claim's
    processes are the claim's memory, counted once; beyond it, foreign."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", 35840), SimClaim("k2", 31744)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 2048)]),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", 35840)]),
            SimPod("p20", "k2", 0, 0, None, [_flat("c0", "app", 15872)]),
            SimPod("p21", "k2", 0, 0, None, [_flat("c0", "app", 15872)])]
    node = DriverDraNode(str(tmp_path), claims, pods, mode=EnforcementMode.COOPERATIVE)
    for _ in range(10):
        node.step()
        assert node.loop.capacities[GPU] == CAP, node.t
        assert node.lent["k1"][-1] >= 35840 and node.lent["k0"][-1] >= 2048, node.lent
    assert node.loop.counts["node_overcommit"] == 0
    assert sum(node.use.values()) == 2048 + 35840 + 2 * 15872  # the engines hold what they want


def test_a_claim_allocated_before_prepare_is_not_taken_for_a_shared_claim_s_file(tmp_path):
    """Found by the wide hunt (VRAMSHARE_HUNT_WIDE=1; fails on deb8676 too): a 10 GiB claim two pods share
    has its quota file; another 10 GiB claim is allocated here for a pod bound at tick 10, prepared at 18.
    The loop merged the file with the unprepared claim of the same size (``merge_claims``: on the kubelet
    path a pod bound here and the file Allocate wrote for it are one container), so it counted 10 GiB
    once for the two, and lent it to a hungry tenant (up to 58,368 MiB, its engine acknowledging 2 ticks
    late); the pod started at its CDI share and the hard limits in force passed the GPU (81,920 MiB on
    80,896). A file its source names is that claim's own, never merged with another claim."""
    def w(name: str, kind: str, top: int) -> Ctr:
        return Ctr(name, kind, True, walk(0, top, 60), init_ticks=1, label=f"walk(0, {top}, 60)")
    claims = [SimClaim("k0", 10240), SimClaim("k1", 10240), SimClaim("k2", 2048), SimClaim("k3", 38912)]
    pods = [SimPod("p00", "k0", 0, 0, None, [w("c0", "app", 20480)], ack_lag=0),
            SimPod("p01", "k0", 0, 0, None, [w("c0", "app", 20480)], ack_lag=0),
            SimPod("p10", "k1", 10, 18, None, [w("c0", "app", 20480)], ack_lag=0, status_lag=1),
            SimPod("p20", "k2", 0, 0, None, [w("c0", "app", 4096)], ack_lag=0),
            SimPod("p30", "k3", 4, 14, None, [w("c0", "init", 77824), w("c1", "app", 77824)], ack_lag=2,
                   status_lag=1)]
    node = DriverDraNode(str(tmp_path), claims, pods)
    for _ in range(12):
        node.step()
    assert node.loop.last.reserved == {GPU: 10240 + 10240 + 38912}  # k0's file, k1 and k3 before Prepare
    run_and_check(node, ticks=12)


@pytest.mark.parametrize("mode", [EnforcementMode.COOPERATIVE, EnforcementMode.MPS])
@settings(max_examples=max(5, EXAMPLES // 3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nodes(pending=True))
def test_in_cooperative_mode_memory_within_its_claims_is_never_foreign(tmp_path_factory, mode, world):
    """Cooperative mode (nothing fences; the loop reads NVML's processes), and MPS mode (the same reader;
    each client pinned at its CDI share): when every container holds no more than its claim's share, every
    MiB on the GPU is some claim's, so the loop books none as foreign (its capacity stays the GPU's) and
    its node check never fires: tenants, shared claims, claims allocated before Prepare, late joiners and
    pending claims (their pod not listed yet, or deleted while its containers exit) are each counted once."""
    claims, pods = world
    for p in pods:
        users = sum(1 for q in pods if q.claim == p.claim for c in q.containers if c.gpu)
        share = next(c.grant for c in claims if c.name == p.claim) // users
        for c in p.containers:
            c.demand = [min(d, share) for d in c.demand]
    node = DriverDraNode(str(tmp_path_factory.mktemp("coop")), claims, pods, mode=mode)
    for _ in range(R.ticks):
        node.step()
        assert node.loop.capacities.get(GPU, CAP) == CAP, (node.t - 1, node.loop.last.reserved)
    assert node.loop.counts["node_overcommit"] == 0


def test_a_loop_restarted_while_a_container_restarts_does_not_lend_its_cdi_share_to_the_sibling(tmp_path):
    """Found by the wide hunt (VRAMSHARE_HUNT_WIDE=1, seed 31; fails on deb8676 too): a 29 GiB claim of two
    app containers (14,848 MiB each in the CDI spec) cut to 36,352 MiB; one container restarts (a new
    cgroup at its spec's share, its ID in the status 2 ticks late) and the quota loop restarts the tick
    after. The new loop bounds what the engine may hold by the hard limits in force (drahunt fix 7b), but
    with a container not found it knew none and took the old file's ceiling (44,544 = 1.5 x the grant):
    the sibling's hard limit rose to it, and it held 44,544 MiB on a claim lent 36,352. The bound counts
    each container not found at its CDI share (``DriverFence.hard_in_force``)."""
    def w(name: str, top: int, restarts: tuple[int, ...] = ()) -> Ctr:
        return Ctr(name, "app", True, walk(0, top, 60), restarts, init_ticks=1, label=f"walk(0, {top}, 60)")
    claims = [SimClaim("k0", 16384), SimClaim("k1", 13312), SimClaim("k2", 29696)]
    pods = [SimPod("p00", "k0", 0, 0, None, [w("c0", 32768)], ack_lag=0),
            SimPod("p10", "k1", 0, 0, None, [w("c0", 26624)], ack_lag=0),
            SimPod("p11", "k1", 0, 0, None, [w("c0", 26624)], ack_lag=0),
            SimPod("p12", "k1", 19, 27, None, [w("c0", 26624)], ack_lag=0),
            SimPod("p13", "k1", 17, 25, None, [w("c0", 26624)], ack_lag=0),
            SimPod("p20", "k2", 7, 15, None, [w("c0", 59392), w("c1", 59392, (3,))], ack_lag=3, status_lag=2)]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=21, restart=19)


# -- pending claims: prepared, but the pod cache shows no container of them (every mode) ------------------------
@pytest.mark.parametrize("mode", [EnforcementMode.COOPERATIVE, EnforcementMode.MPS, EnforcementMode.DRIVER])
def test_a_prepared_claim_whose_pod_the_cache_does_not_show_yet_is_counted_once(tmp_path, mode):
    """A 8 GiB claim is prepared and its pod's engine holds the grant from tick 0, while this node's pod
    cache lists the pod only from tick 4 (its watch lags the kubelet's). Meanwhile the claim is no tenant:
    the loop counts it at its grant, and NVML's process (its cgroup naming the pod's UID) matched nothing,
    so it was foreign on top: 8,192 MiB counted twice, capacity read as 72,704, and the 71 GiB tenant beside
    it cut to 64,512 while it used its whole grant. The process's pod is one the prepared claim reserves:
    its memory is the claim's, up to the grant."""
    claims = [SimClaim("k0", 8192), SimClaim("k1", CAP - 8192)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 8192)], cache_lag=4),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", CAP - 8192)])]
    node = DriverDraNode(str(tmp_path), claims, pods, mode=mode)
    for _ in range(8):
        node.step()
        assert node.loop.capacities[GPU] == CAP, (node.t - 1, node.loop.capacities)
        assert node.loop.last.reserved == ({GPU: 8192} if node.t - 1 < 4 else {}), node.loop.last.reserved
        assert node.lent["k1"][-1] >= CAP - 8192, node.lent
    assert node.use[("p00", "c0")] == 8192 and node.loop.counts["node_overcommit"] == 0


@pytest.mark.parametrize("mode", [EnforcementMode.COOPERATIVE, EnforcementMode.MPS, EnforcementMode.DRIVER])
def test_a_deleted_pod_s_claim_counts_at_its_grant_until_the_kubelet_unprepares_it(tmp_path, mode):
    """The right count of a claim whose pod is deleted (gone from the pod cache) while the kubelet has not
    unprepared it yet: its grant, once, with its processes' memory inside it. The pod is no tenant any more
    (departed), but its containers may still hold memory until they exit, and the claim's devices are this
    node's until Unprepare: counted at max(grant, what its processes hold), the part beyond the grant foreign
    (held by nobody the loop may cut). Here the pod leaves the cache at tick 4, its engine exits at 7 and
    the kubelet unprepares the claim 2 ticks later: from 4 to 6 the claim is reserved at 8,192 MiB and its
    engine's 8,192 are not foreign (on the base both: capacity 72,704); at 7 and 8 it still counts at its
    grant (the devices are the claim's until Unprepare: cautious, never unsound); from 9 on nothing."""
    claims = [SimClaim("k0", 8192, unprepare_lag=2), SimClaim("k1", CAP - 8192)]
    pods = [SimPod("p00", "k0", 0, 0, 4, [_flat("c0", "app", 8192)], linger=3),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", CAP - 8192)])]
    node = DriverDraNode(str(tmp_path), claims, pods, mode=mode)
    reserved, held = [], []
    for _ in range(11):
        node.step()
        assert node.loop.capacities[GPU] == CAP, (node.t - 1, node.loop.capacities)
        assert node.lent["k1"][-1] >= CAP - 8192, node.lent
        reserved.append(node.loop.last.reserved.get(GPU, 0))
        held.append(node.use.get(("p00", "c0"), 0))
    assert reserved == [0] * 4 + [8192] * 5 + [0] * 2, reserved  # a tenant, then pending at its grant
    assert held == [8192] * 7 + [0] * 4, held
    assert node.loop.counts["node_overcommit"] == 0


def test_a_shared_claim_whose_second_pod_the_cache_does_not_show_yet_is_held_at_its_grant(tmp_path):
    """The driver property's first case once it drew pending pods: a 2 GiB claim prepared for two pods
    (its CDI spec: 1,024 MiB for each one's container), the second listed by the pod cache 3 ticks after
    its start. The sharers were counted from the pods in the cache only, so the fence held the listed
    pod's container at the whole 2,048 while the unlisted one ran at its 1,024 share: 3,072 MiB of hard
    limits (and of use) on a 2,048 MiB claim. The sharers are the pods the claim was prepared for (the
    checkpoint's), and the unlisted pod's container is found by its pod's cgroup and held with the rest."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", CAP - 2048)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 2048)]),
            SimPod("p01", "k0", 0, 0, None, [_flat("c0", "app", 2048)], cache_lag=3),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", CAP - 2048)])]
    node = DriverDraNode(str(tmp_path), claims, pods)
    for _ in range(8):
        node.step()
        mine = [(p, c) for p in pods[:2] for c in node.live(p)]
        assert sum(node.hard(p, c) for p, c in mine) <= 2048, (node.t - 1, [node.hard(p, c) for p, c in mine])
        assert sum(node.use[(p.name, c.name)] for p, c in mine) <= 2048, (node.t - 1, node.use)
        assert sum(node.hard(p, c) for p in pods for c in node.live(p)) <= CAP, node.t - 1
    assert node.loop.counts["node_overcommit"] == 0


def test_a_shared_claim_s_pod_deleted_for_good_keeps_no_share_once_its_containers_exited(tmp_path):
    """The other side of counting sharers from the checkpoint: a pod the claim was prepared for that the pod
    cache listed and lists no more was deleted, and starts nothing again. Once its containers exited, the
    pod left running may hold the whole grant (as the listed pods' count gave it on the base), not the
    grant less a share kept for a container that will never start, until the kubelet unprepares the claim."""
    claims = [SimClaim("k0", 2048), SimClaim("k1", CAP - 2048)]
    pods = [SimPod("p00", "k0", 0, 0, None, [_flat("c0", "app", 2048)]),
            SimPod("p01", "k0", 0, 0, 3, [_flat("c0", "app", 2048)], linger=1),
            SimPod("p10", "k1", 0, 0, None, [_flat("c0", "app", CAP - 2048)])]
    node = DriverDraNode(str(tmp_path), claims, pods)
    hards = []
    for _ in range(8):
        node.step()
        hards.append([node.hard(p, c) for p in pods[:2] for c in node.live(p)])
    # shared: 1,024 each; p01 deleted at 3, its container held until it exits at 4; then p00 alone
    assert hards[:3] == [[1024, 1024]] * 3 and hards[3] == [1024, 1024], hards
    assert hards[-1] == [2048] and node.use[("p00", "c0")] == 2048, hards


def test_a_tenant_restarted_while_lent_is_fenced_at_its_cut_before_its_engine_acknowledges(tmp_path):
    """Found by drafence's hunt (seed 1, 1,000 examples; no pending claim), pinned there as a strict xfail
    (``..._exceeds_the_gpu_until_its_engines_acknowledge``). A 47 GiB claim cut to 46,080 MiB lends to two
    tenants (up to 12,288 and 22,187 MiB, engines acknowledging 0 and 2 ticks late); its container restarts
    at tick 11 and comes back at its CDI spec's 48,128 (the loop, still on the old ID, counts it at that
    share and cuts the borrower to 19,456, not acknowledged yet). The loop sees the new ID at 12 and decides
    a shrink to 44,373, raising the borrower back. It kept the restarted container's hard limit at 48,128
    until its engine acknowledged (issue 19): 82,603 MiB of hard limits on the 80,896 MiB GPU until tick 14.
    The acknowledgement on record was the old instance's; the new one holds nothing yet, so its hard limit
    is the decision's at once. (Since round 18 the loop counts p20, which reports late, at the file it may
    follow until it reports, so the run differs from tick 1: 46,080 at 11, a shrink to 44,032 at 12.)"""
    def w(name: str, kind: str, seed: int, top: int, restarts: tuple[int, ...] = ()) -> Ctr:
        return Ctr(name, kind, True, walk(seed, top, TICKS), restarts, init_ticks=1, label=f"walk({seed}, {top})")
    claims = [SimClaim("k0", 8192), SimClaim("k1", 16384), SimClaim("k2", 48128)]
    pods = [SimPod("p00", "k0", 0, 0, None, [w("c0", "app", 1, 12288)], ack_lag=0),
            SimPod("p10", "k1", 0, 0, None, [w("c0", "init", 0, 24576), w("c1", "app", 0, 24576)], ack_lag=2),
            SimPod("p20", "k2", 0, 0, None, [w("c0", "app", 1, 72192, (11,))], ack_lag=2, status_lag=1)]
    node = DriverDraNode(str(tmp_path), claims, pods, PolicyParams(headroom="peak"))
    run_and_check(node, ticks=13)
    restarted = pods[2].containers[0]
    assert node.lent["k2"][11:] == [46080, 44032] and node.hard(pods[2], restarted) == 44032, node.lent["k2"]
    run_and_check(node, ticks=14)


def test_a_claim_whose_only_pod_the_cache_lists_after_its_start_is_lent_before_prepare(tmp_path):
    """Found by this branch's hunt once it drew pending pods in driver mode with container restarts left out
    (seed 1): an 11 GiB claim is allocated here for a pod bound at tick 1 that the kubelet starts at 7, while
    this node's pod cache lists the pod only from 8. Before Prepare only the pod cache tells the loop of the
    claim (``tenants.unprepared_claims``, ``AllocatedClaims``), so the loop lent its memory to the two
    tenants beside it (up to 27,648 and 43,008 MiB); at 7 the container starts at its CDI share on top:
    81,920 MiB of hard limits on the 80,896 MiB GPU. With the pod listed from its bind the same world passes
    (the claim counted from tick 1). Not the driver fence's (any mode lends the same); the sim's lag runs from
    the pod's start, so a pod bound 6 ticks before it is unlisted for 7 ticks: the property's generator
    draws a lag only where the loop can know the claim before its first start. Was a strict xfail; passes since
    the fence fits every write to the GPU's capacity (``fence.fit_to_capacity``): at 7 the fence finds the
    container by its pod's cgroup and holds it at 10,240 (its use, below its 11,264 share) beside the loans,
    80,896 in all; it gets its share as the lenders release (at 9). The loop still lends before Prepare."""
    def w(seed: int, top: int) -> Ctr:
        return Ctr("c0", "app", True, walk(seed, top, TICKS), init_ticks=1, label=f"walk({seed}, {top})")
    claims = [SimClaim("k0", 11264), SimClaim("k1", 18432), SimClaim("k2", 28672)]
    pods = [SimPod("p00", "k0", 1, 7, None, [w(0, 16896)], ack_lag=0, cache_lag=1),
            SimPod("p10", "k1", 0, 0, None, [w(0, 27648)], ack_lag=0),
            SimPod("p20", "k2", 0, 0, None, [w(75, 43008)], ack_lag=2)]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=12)


def _restarting(seed: int, top: int, restart: int, name: str = "c0") -> Ctr:
    """An app container walking up to ``top`` MiB that restarts at tick ``restart``."""
    return Ctr(name, "app", True, walk(seed, top, TICKS), (restart,), init_ticks=1, label=f"walk({seed}, {top})")


def test_a_tenant_one_of_whose_two_containers_restarted_while_lent_is_fenced_at_its_cut(tmp_path):
    """Found by drarestart's focused hunt (single-pod claims, every container restarting, status and
    acknowledgement lags of 1 or more; seed 2, 1,500 examples); it fails the same on the base, 6e41251. The
    restart-while-lent case above with a tenant of two app containers (CDI share 20,480 each of 40,960): c0
    restarts at 18 while the claim lends; the loop, still on its old ID, counts it at its share, raises the
    claim to 38,936 and cuts a borrower (not acknowledged). At 19 it sees the new ID and shrinks the claim to
    25,003, raising the borrower back, but c1 was there before, so the claim's hard limit waits for the
    engine: 86,409 MiB of hard limits on the GPU. The new container, started while a shrink waits, is held
    at its split of the decision (``DriverFence.apply``'s fresh cgroups); the old one keeps its part."""
    claims = [SimClaim("k0", 20480), SimClaim("k1", 19456), SimClaim("k2", 40960)]
    pods = [SimPod("p00", "k0", 0, 1, 20, [_restarting(0, 30720, 2)], ack_lag=2, status_lag=1),
            SimPod("p10", "k1", 0, 2, None, [_restarting(0, 29184, 2)], ack_lag=1, status_lag=1),
            SimPod("p20", "k2", 0, 0, None, [_restarting(53500, 61440, 18), _restarting(678, 61440, 2, "c1")], ack_lag=2, status_lag=1)]
    run_and_check(DriverDraNode(str(tmp_path), claims, pods), ticks=21)


def test_a_tenant_raised_for_a_restarting_container_keeps_the_raise_from_its_old_sibling(tmp_path):
    """Found by drarestart's focused hunt once the case above passed (seed 2; fails the same on the base,
    6e41251). A 36 GiB claim of two app containers (a throttling engine) lends to two tenants; c0 restarts
    at tick 21. The loop, still on its old ID, counts it at its CDI share (18,432), raises the claim to its
    grant and cuts both borrowers, whose engines have not acknowledged at 22. At 22 it sees the new ID and
    shrinks the claim to 34,816: the new c0 is held at its split of that (0: the old c1, at its hard limit,
    takes the rest), but c1 keeps its split of the bound that waits, the whole 36,864 (within the grant),
    beside the borrowers' loans: 83,968 MiB of hard limits on the GPU. The raise was made for a share the
    old sibling took (pinned as a strict xfail, ``..._lets_its_old_sibling_take_the_raise``). While a
    container that started during a waiting shrink runs, its old siblings keep no more than the hard limit
    they had (``fence.restart_split``): c1 stays at 18,432, 65,536 MiB on the GPU at 22."""
    claims = [SimClaim("k0", 15360), SimClaim("k1", 17408), SimClaim("k2", 36864)]
    pods = [SimPod("p00", "k0", 0, 1, 23, [_restarting(159, 23040, 5)], ack_lag=2, status_lag=1),
            SimPod("p10", "k1", 0, 1, None, [_restarting(0, 26112, 2)], ack_lag=1, status_lag=1),
            SimPod("p20", "k2", 1, 7, None, [_restarting(53500, 55296, 14), _restarting(166, 55296, 2, "c1")], mode="throttle",
                   ack_lag=2, status_lag=1)]
    node = DriverDraNode(str(tmp_path), claims, pods, PolicyParams(headroom="peak"))
    run_and_check(node, ticks=23)
    assert node.lent["k2"][21:] == [36864, 34816] and node.hard(pods[2], pods[2].containers[1]) == 18432
    run_and_check(node, ticks=TICKS - 23)


def test_a_lent_claim_whose_pod_is_deleted_is_not_raised_to_its_grant_while_its_borrowers_cuts_wait(tmp_path):
    """Found by drarestart2's focused hunt (single-pod claims, every container restarting, status and
    acknowledgement lags of 1 or more; seed 2, after 270 passing); it fails the same on the base, 5082de4.
    A 40 GiB claim lends (39,424 at tick 8) to a 10 GiB claim's engine (14,848, acknowledging 2 ticks
    late). At 9 its pod is deleted and drops from the pod cache while its container exits: the claim is no
    tenant any more, counted at its grant until the kubelet unprepares it, so the loop cuts the borrower to
    12,288 (not acknowledged). The fence held the exiting container, found by its pod's cgroup, at the
    whole grant at once: 14,848 + 26,112 + 40,960 = 81,920 MiB of hard limits on the 80,896 MiB GPU. A
    container of a pod the cache does not list keeps no more than the hard limit it had (a deleted pod's:
    its tenant's split; a pod not listed yet: its CDI share)."""
    def w(seed: int, top: int) -> Ctr:
        return Ctr("c0", "app", True, walk(seed, top, TICKS), (2,), init_ticks=1, label=f"walk({seed}, {top})")
    claims = [SimClaim("k0", 10240), SimClaim("k1", 19456), SimClaim("k2", 40960)]
    pods = [SimPod("p00", "k0", 0, 2, 10, [w(1, 15360)], ack_lag=2, status_lag=1),
            SimPod("p10", "k1", 0, 1, None, [w(0, 29184)], ack_lag=1, status_lag=1),
            SimPod("p20", "k2", 0, 0, 9, [w(1, 61440)], ack_lag=1, status_lag=1, linger=1)]
    node = DriverDraNode(str(tmp_path), claims, pods, PolicyParams(headroom="peak"))
    run_and_check(node, ticks=10)
    assert node.lent["k2"][8] == 39424 and node.hard(pods[2], pods[2].containers[0]) == 39424
    run_and_check(node, ticks=TICKS - 10)

"""Node policy: a pod whose node is lost (`runPolicy.nodeLostSeconds`).

When a node stops answering (its kubelet stopped, the machine gone, a partition), Kubernetes
marks it NotReady after its node-monitor-grace-period (50 s by default) and its pods not
ready, but leaves them Running; a pod deleted there stays Terminating, since only its kubelet
can say it stopped. With one node, or every node of a zone, lost, Kubernetes evicts nothing
at all. A TFJob then waits forever. Here, while a pod's node is not Ready, the job's PodsReady
condition says so (NodeNotReady: which pod, which node, since when, the node's own words);
once the node has been NotReady for `nodeLostSeconds` (default `DEFAULT_SECONDS`), the pod is
deleted at once (grace period 0: nothing on the node can end it more gently), an Event
NodeLost says so, and it is replaced like any pod Kubernetes ended: counted in
`status.restarts`, never against `backoffLimit`. The replacement waits, Pending with the
scheduler's words, until a node can take it; the job resumes from its checkpoint as for any
replaced task.

A node that is only cut off may still run the old process: it is fenced as a replaced task's
predecessor is (its peers now reach the replacement by name; the chief's recovery and the ps'
incarnations refuse its stale calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator.conditions import Status, stamp
from jaxps_operator.objects import Plan, PodState
from jaxps_operator.policy import restart

DEFAULT_SECONDS = 60
"""How long a pod's node may be NotReady before the pod is taken for lost: a kubelet restarted
for an upgrade comes back within it (after the node-monitor-grace-period that precedes it)."""


def limit(job: Mapping[str, Any]) -> int:
    return int(job["spec"]["runPolicy"].get("nodeLostSeconds", DEFAULT_SECONDS))


def apply(job: Mapping[str, Any], *, pods: Iterable[PodState], status: Status, plan: Plan) -> bool:
    """Deletes (at once) and counts the pods whose node is lost; reports those whose node is
    not Ready yet for long. True when some pod waits on its node (PodsReady then says which)."""
    seconds = limit(job)
    lost = sorted(
        (p for p in pods if p.node_lost and p.node_lost_since is not None),
        key=lambda p: (p.node_lost_since, p.name),
    )
    waiting: list[tuple[PodState, float]] = []
    for pod in lost:
        assert pod.node_lost_since is not None
        down = (status.now - pod.node_lost_since).total_seconds()
        if down < seconds:
            waiting.append((pod, down))
            plan.wake_in(seconds - down)
            continue
        if pod.name in plan.force:
            continue
        plan.force.append(pod.name)
        if pod.name not in plan.delete:
            plan.delete.append(pod.name)
        status.event(
            "Warning",
            "NodeLost",
            f"pod {pod.name} ({pod.task}): its node {pod.node} has been NotReady for "
            f"{down:.0f} s, past runPolicy.nodeLostSeconds ({seconds} s): {pod.node_lost}; "
            "deleted at once, to be replaced where a node can take it",
        )
        if pod.deleting:  # already counted, or the job's own deletion (scale, cleanup)
            continue
        restart.count(pod, status=status, plan=plan)
    if not waiting:
        return False
    pod, _ = waiting[0]
    assert pod.node_lost_since is not None
    more = f" (and {len(waiting) - 1} more pods)" if len(waiting) > 1 else ""
    message = (
        f"pod {pod.name} ({pod.task}) is on node {pod.node}, NotReady since "
        f"{stamp(pod.node_lost_since)}: {pod.node_lost}{more}; taken for lost and replaced "
        f"after runPolicy.nodeLostSeconds ({seconds} s)"
    )
    before = dict(status.condition("PodsReady") or {})  # a copy: mark changes it in place
    status.mark("PodsReady", False, "NodeNotReady", message)
    if (before.get("reason"), before.get("message")) != ("NodeNotReady", message):
        status.event("Warning", "NodeNotReady", message)
    return True

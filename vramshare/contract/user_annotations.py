"""The pod annotations a user may write (DESIGN.md section 3, "user pod annotations"); every other
``<domain>/*`` annotation is written by vramshare only."""
from __future__ import annotations

#: The pod annotations users write themselves, under the domain; every other ``<domain>/*`` annotation
#: is written by vramshare only. The one list: deploy/daemonset/admission-policies.yaml exempts exactly
#: these from its protection (tests/security/test_admission_policies.py evaluates its CEL against this
#: tuple) and every one README tells users to write must be here (tests/test_readme_pod.py).
#: gpu-count, gpu-models: placement; policy: scoring override; quota-class: the pod's choice of quota
#: class (issue 14); model: the model a pod serves (issue 23, cold starts); isolation: ``mig`` serves the
#: pod's gpu-memory ask as a MIG partition of the smallest fitting profile (issue 24, dynamic MIG).
USER_ANNOTATIONS: tuple[str, ...] = ("gpu-count", "gpu-models", "policy", "quota-class", "model", "isolation")


#: The pod annotations only vramshare writes: the bind handshake (the extender's plan, rewritten by the
#: device plugin) and the quota loop's two mirrors. The DRA plugin may write only the quota loop's two
#: (deploy/daemonset/admission-policies.yaml, policy 2); tests/security/test_admission_policies.py
#: checks the policies against these tuples.
HANDSHAKE_ANNOTATIONS: tuple[str, ...] = ("assignment", "assume-time", "allocation-state")
QUOTA_LOOP_ANNOTATIONS: tuple[str, ...] = ("quota-mib", "over-limit")
#: The node annotations: only the node plugins write them (gpu-inventory the device plugin, resident-models
#: the DRA plugin and nothing else of the node: deploy/daemonset/admission-policies.yaml, policy 2).
NODE_ANNOTATIONS: tuple[str, ...] = ("gpu-inventory", "resident-models")
#: The ResourceSlice annotations: the DRA plugin writes them on its own slices (the DRA admission policy
#: lets a node's plugin write only its node's slices of our driver); config: the config text it runs.
SLICE_ANNOTATIONS: tuple[str, ...] = ("config",)

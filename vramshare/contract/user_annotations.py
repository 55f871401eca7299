"""The pod annotations a user may write (DESIGN.md section 3, "user pod annotations"); every other
``<domain>/*`` annotation is written by vramshare only."""
from __future__ import annotations

#: The pod annotations users write themselves, under the domain; every other ``<domain>/*`` annotation
#: is written by vramshare only. The one list: deploy/daemonset/admission-policies.yaml exempts exactly
#: these from its protection (tests/security/test_admission_policies.py evaluates its CEL against this
#: tuple) and every one README tells users to write must be here (tests/test_readme_pod.py).
#: gpu-count, gpu-models: placement; policy: scoring override; quota-class: the pod's choice of quota
#: class (issue 14); model: the model a pod serves (issue 23, cold starts).
USER_ANNOTATIONS: tuple[str, ...] = ("gpu-count", "gpu-models", "policy", "quota-class", "model")



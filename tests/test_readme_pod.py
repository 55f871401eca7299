"""The README's example pod is one a user can apply as written: it names the vramshare scheduler and the
NVIDIA RuntimeClass (without it the container starts without a GPU where NVIDIA's runtime is not the
default), and it passes the admission policy's scheduler rule.

Every ``vramshare.io/*`` annotation README tells users to write (in a YAML example's
``metadata.annotations``, commented-out lines included, or inline as `` `vramshare.io/<key>: <value>` ``)
is in the contract's one list (``contract.USER_ANNOTATIONS``) and is admitted by the shipped admission
policies, evaluated with the CEL interpreter as tests/security/test_admission_policies.py does (issue 17:
README's quota-class example was refused on a cluster running our manifests)."""
from __future__ import annotations

import copy
import pathlib
import re
from typing import Any, Iterator

import pytest
import yaml

from tests.security.admission import Request, admit
from vramshare import contract

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
N = contract.Names()
TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"```yaml\n(.*?)```", TEXT, flags=re.S)


def _example_pods() -> list[dict[str, Any]]:
    return [d for b in BLOCKS for d in yaml.safe_load_all(b) if isinstance(d, dict) and d.get("kind") == "Pod"]


def test_the_example_pod_names_the_scheduler_and_the_runtime_class():
    pods = _example_pods()
    assert pods, "README has no example Pod"
    spec = pods[0]["spec"]
    assert spec["schedulerName"] == "vramshare-scheduler"
    assert spec["runtimeClassName"] == "nvidia"
    assert "nodeName" not in spec


def _annotations(node: Any) -> Iterator[tuple[str, str]]:
    """(key, value) of every metadata.annotations entry anywhere in a YAML document (templates too)."""
    if isinstance(node, dict):
        meta = node.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("annotations"), dict):
            yield from ((str(k), str(v)) for k, v in meta["annotations"].items())
        for v in node.values():
            yield from _annotations(v)
    elif isinstance(node, list):
        for v in node:
            yield from _annotations(v)


_COMMENTED = re.compile(r"^\s*#\s*(" + re.escape(N.domain) + r"/[a-z0-9.-]+):\s*\"?([^\"#]*?)\"?\s*(?:#.*)?$", re.M)
_INLINE = re.compile(r"`(" + re.escape(N.domain) + r"/[a-z0-9.-]+): ([^`]+)`")


def _is_resource(key: str) -> bool:
    """A resource name (asked for under resources.limits), not an annotation."""
    return key in {N.gpu_memory, N.gpu} or key.startswith(N.mig_prefix)


def readme_user_annotations() -> dict[str, str]:
    """Every vramshare.io/* annotation README tells users to write -> an example value it gives."""
    found: dict[str, str] = {}
    for block in BLOCKS:
        for doc in yaml.safe_load_all(block):
            found.update((k, v) for k, v in _annotations(doc) if k.startswith(f"{N.domain}/"))
        found.update((k, v.strip()) for k, v in _COMMENTED.findall(block))
    found.update((k, v.strip().strip('"')) for k, v in _INLINE.findall(TEXT) if not _is_resource(k))
    return found


def test_the_scan_finds_the_annotations_readme_shows():
    """The scan itself: the example pod's annotation, its commented-out options, example 2's opt-in."""
    found = readme_user_annotations()
    assert {N.gpu_models, N.gpu_count, N.policy, N.quota_class} <= set(found), found
    assert found[N.quota_class] == "burst"


@pytest.mark.parametrize("key, value", sorted(readme_user_annotations().items()))
def test_every_annotation_readme_tells_users_to_write_is_theirs_and_admitted(key: str, value: str):
    assert key in N.user_annotations(), f"README tells users to write {key}: add it to contract.USER_ANNOTATIONS"
    pod = copy.deepcopy(_example_pods()[0])
    pod["metadata"]["annotations"] = {key: value}
    pod["metadata"].setdefault("namespace", "default")
    assert admit(Request("CREATE", "pods", "alice@example.com", pod)) == [], f"{key}: {value} is refused"
    changed = copy.deepcopy(pod)
    changed["metadata"]["annotations"][key] = value + "x"
    assert admit(Request("UPDATE", "pods", "alice@example.com", changed, pod)) == []


def test_the_security_section_names_the_users_annotations():
    [said] = re.findall(r"users write only ([^)]*)\)", TEXT)
    for name in contract.USER_ANNOTATIONS:
        assert f"`{name}`" in said, f"README Security: 'users write only ...' misses {name}"


def _warm_tier_pod() -> dict[str, Any]:
    """README's warm-tier example: the pod (template) of the Deployment it shows, with an IP."""
    [block] = [b for b in BLOCKS if "warmTier:" in b and N.model in b]
    [tmpl] = [d for d in yaml.safe_load_all(block) if isinstance(d, dict) and "containers" in (d.get("spec") or {})]
    return {**copy.deepcopy(tmpl), "status": {"phase": "Running", "podIP": "10.1.2.3"}}


def test_the_warm_tier_example_pod_can_go_to_sleep():
    """Issue 23 end to end (tests/test_warm_e2e.py runs it): the quota loop finds a pod idle only from its
    engine's ``/metrics``, at the URL its ``prometheus.io/*`` annotations and its IP name
    (``deviceplugin/quota/kube.py`` ``metrics_url``); a tenant without signals is never warm, so its engine
    is never asked to sleep. On main README's example had no such annotation: as written it never slept.
    And the engine reports the model the pod names (``VRAMSHARE_MODEL`` from the same annotation the
    extender's residency term reads), so the inventory and the pod agree."""
    from deviceplugin.quota.kube import metrics_url

    pod = _warm_tier_pod()
    [vllm] = pod["spec"]["containers"]
    assert metrics_url(pod) == "http://10.1.2.3:8000/metrics"  # vLLM's API server serves /metrics on its port
    [env] = [e for e in vllm.get("env", []) if e["name"] == "VRAMSHARE_MODEL"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{N.model}']"
    assert pod["metadata"]["annotations"][N.model] in vllm["args"]  # the model it serves is the one it names
    assert "--enable-sleep-mode" in vllm["args"]


def _kind_of_fragment(doc: dict[str, Any]) -> str:
    """README's YAML without a ``kind``: a config fragment (its keys are config keys), a pod template
    (``metadata`` + ``spec``), a pod ``spec`` or a claim request's ``selectors``."""
    if "spec" in doc and set(doc) <= {"metadata", "spec"}:
        return "pod"
    if set(doc) == {"selectors"}:
        return "selectors"
    return "config"


@pytest.mark.parametrize("version", ["1.33", "1.36"])
def test_every_yaml_example_readme_shows_is_valid(version: str):
    """A new admin copies README's YAML: each object validates against the API's schema
    (kubernetes-validate, strict: an unknown field is an error), a pod fragment as the pod it goes into,
    a config fragment loads as the ConfigMap's config, and the DRA selector is the example template's."""
    import kubernetes_validate

    from vramshare import config

    seen = set()
    for block in BLOCKS:
        for doc in yaml.safe_load_all(block):
            if not isinstance(doc, dict):
                continue
            kind = doc.get("kind") or _kind_of_fragment(doc)
            seen.add(kind)
            if kind == "selectors":
                examples = (README.parent / "deploy/daemonset/dra/examples/claim-templates.yaml").read_text()
                expression = doc["selectors"][0]["cel"]["expression"]
                assert " ".join(expression.split()) in " ".join(examples.split())
                continue
            if kind == "config":
                config.config_from_dict({"version": "v1", **doc})  # raises ConfigError naming the key
                continue
            if kind == "pod":
                if "resourceClaims" in doc["spec"] and version < "1.34":
                    continue  # the DRA path's pod: resource.k8s.io/v1 from 1.34
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **doc.get("metadata", {})},
                       "spec": {**doc["spec"], "containers": [{"image": "vllm/vllm-openai:latest", **c}
                                                              for c in doc["spec"]["containers"]]}}
                kubernetes_validate.validate(pod, version, strict=True)
                continue
            kubernetes_validate.validate(doc, version, strict=True)
    assert {"Pod", "Role", "config", "pod", "selectors"} <= seen, seen

"""Evaluate the ValidatingAdmissionPolicies of deploy/daemonset/ (and dra/) the way the API server does.

The expressions are read from the YAML files and run with the ``common-expression-language`` CEL
interpreter (a test-only dependency), never copied by hand. What the API server adds around them,
reproduced here after staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating
(``validator.Validate``): match by resource and operation, then every ``matchConditions`` expression
(all true, or the policy does not apply), then ``variables`` in order (each sees the earlier ones as
``variables.<name>``), then each validation; the first false one denies with its ``messageExpression``
(or ``message``). An expression that fails to evaluate denies (``failurePolicy: Fail``).

Kubernetes' CEL environment has library extensions beyond standard CEL; the only one the policies use
is ``<list of strings>.join(separator)`` (cel-go ext.Strings), registered below as a custom function.
"""
from __future__ import annotations

import copy
import pathlib
from dataclasses import dataclass
from typing import Any

import cel
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICY_FILE = ROOT / "deploy" / "daemonset" / "admission-policies.yaml"
#: both kustomizations' policies: a cluster on the DRA path has them all installed
POLICY_FILES = (POLICY_FILE, ROOT / "deploy" / "daemonset" / "dra" / "admission-policies.yaml")

Obj = dict[str, Any]
EXT = {"join": lambda items, sep: sep.join(items)}


def load() -> tuple[dict[str, Obj], dict[str, Obj]]:
    """(policies by name, bindings by policy name) from the manifests."""
    docs = [d for f in POLICY_FILES for d in yaml.safe_load_all(f.read_text()) if d]
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {d["spec"]["policyName"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    return policies, bindings


@dataclass(frozen=True)
class Request:
    operation: str
    resource: str  # "pods", "nodes" or "resourceslices"
    username: str
    obj: Obj | None
    old: Obj | None = None
    extra: dict[str, list[str]] | None = None

    @property
    def group(self) -> str:
        return "resource.k8s.io" if self.resource in {"resourceslices", "resourceclaims", "deviceclasses"} else ""

    def context(self) -> dict[str, Any]:
        return {
            "request": {"operation": self.operation, "resource": {"group": self.group, "version": "v1",
                                                                  "resource": self.resource},
                        "userInfo": {"username": self.username, "extra": self.extra or {}}},
            "object": copy.deepcopy(self.obj), "oldObject": copy.deepcopy(self.old),
        }


def _matches(policy: Obj, req: Request) -> bool:
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        if (req.group in rule["apiGroups"] and req.resource in rule["resources"]
                and req.operation in rule["operations"]):
            return True
    return False


def _eval(expr: str, ctx: dict[str, Any]) -> Any:
    return cel.evaluate(expr, cel.Context(ctx, EXT))


def evaluate(policy: Obj, req: Request) -> str | None:
    """None when the policy admits ``req`` (or does not apply), else the denial message."""
    if not _matches(policy, req):
        return None
    ctx = req.context()
    spec = policy["spec"]
    try:
        for cond in spec.get("matchConditions", []):
            if not _eval(cond["expression"], ctx):
                return None
        ctx["variables"] = {}
        for var in spec.get("variables", []):
            ctx["variables"][var["name"]] = _eval(var["expression"], ctx)
        for check in spec["validations"]:
            if not _eval(check["expression"], ctx):
                if "messageExpression" in check:
                    return str(_eval(check["messageExpression"], ctx))
                return " ".join(check["message"].split())
    except Exception as exc:  # noqa: BLE001 - failurePolicy: Fail
        return f"policy {policy['metadata']['name']} failed to evaluate: {exc}"
    return None


def admit(req: Request) -> list[str]:
    """Denials of every bound policy (empty: admitted)."""
    policies, bindings = load()
    out = []
    for name, policy in policies.items():
        if name in bindings and "Deny" in bindings[name]["spec"]["validationActions"]:
            msg = evaluate(policy, req)
            if msg is not None:
                out.append(f"{name}: {msg}")
    return out

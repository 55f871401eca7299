"""The eviction right only where overLimitAction: evict is configured (issue 17 item 15).

The default ClusterRoles no longer grant ``pods/eviction create`` (tests/deploy/test_manifests.py); the
opt-in component deploy/components/over-limit-evict does. A plugin whose config asks for evict asks the
API server (SelfSubjectAccessReview) whether it may, and without the right refuses to start (naming the
component) and refuses a reload that turns evict on, keeping the last good config. The API server
double answers SelfSubjectAccessReviews as upstream's REST.Create does (conformance below).
"""
from __future__ import annotations

import os

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from deviceplugin.config_watch import ConfigWatcher
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.quota import rights
from vramshare.config import Config, EnforcementConfig, OverLimitAction, parse_config

EVICT = parse_config("enforcement: {overLimitAction: evict}")
CLASS_EVICTS = parse_config("quota: {classes: [{name: batch, overLimitAction: evict, match: [{namespaces: [b]}]}]}")


def _review(http: client.ApiClient, **attrs: str) -> client.V1SelfSubjectAccessReview:
    body = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(**attrs)))
    return client.AuthorizationV1Api(http).create_self_subject_access_review(body)


# -- the stand-in answers as the API server does ------------------------------------------------------
def test_the_double_answers_access_reviews_in_the_api_servers_shape(api, http):
    """selfsubjectaccessreview/rest.go REST.Create: 201 with the review and status.allowed; what no rule
    grants is not allowed and not denied (RBAC has no opinion); a spec without attributes is Invalid."""
    got = _review(http, group="", resource="pods", subresource="eviction", verb="create")
    assert got.status.allowed is True and got.kind == "SelfSubjectAccessReview"
    api.access.deny("create", "pods", "eviction")
    got = _review(http, group="", resource="pods", subresource="eviction", verb="create")
    assert got.status.allowed is False and not got.status.denied
    assert _review(http, resource="pods", verb="patch").status.allowed is True
    with pytest.raises(ApiException) as err:
        client.AuthorizationV1Api(http).create_self_subject_access_review(
            client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec()))
    assert err.value.status == 422 and "exactly one of nonResourceAttributes or resourceAttributes" in err.value.body


# -- the plugin --------------------------------------------------------------------------------------
def test_evict_is_configured_at_the_top_or_in_a_class():
    assert rights.evicting(Config()) == []
    assert rights.evicting(EVICT) == ["enforcement.overLimitAction"]
    assert rights.evicting(CLASS_EVICTS) == ["quota.classes[batch].overLimitAction"]


@pytest.mark.parametrize("cfg", [EVICT, CLASS_EVICTS], ids=["global", "class"])
def test_a_plugin_without_the_eviction_right_refuses_evict_at_start(cfg, api, http, backend, kubelet, short_dir):
    api.access.deny("create", "pods", "eviction")
    cfg = cfg.with_overrides(quota_host_dir=os.path.join(short_dir, "quota"))
    with pytest.raises(rights.RightRefused, match="evict refused: .*may not create pods/eviction.*"
                                                  "deploy/components/over-limit-evict"):
        DevicePluginDaemon(backend, cfg, kubelet.plugin_dir, node_name="gpu-1", api=http)


def test_with_the_right_evict_starts_and_without_evict_nothing_is_asked(api, http, start_plugin, config):
    daemon = start_plugin(Config(quota_host_dir=config.quota_host_dir,
                                 enforcement=EnforcementConfig(over_limit_action=OverLimitAction.EVICT)), api=http)
    assert daemon.state.snapshot.config.enforcement.over_limit_action is OverLimitAction.EVICT
    assert api.count("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews") == 1
    api.clear_requests()
    api.access.deny("create", "pods", "eviction")
    rights.check(Config(), http)  # event: no question asked
    assert api.count("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews") == 0


def test_a_reload_that_turns_evict_on_without_the_right_is_refused_and_the_last_good_config_stays(
        api, http, start_plugin, config, tmp_path):
    api.access.deny("create", "pods", "eviction")
    daemon = start_plugin(config, api=http)
    path = tmp_path / "config.yaml"
    path.write_text("quota: {enabled: false}\n")
    overrides = {"quota_host_dir": config.quota_host_dir}
    first = parse_config(path.read_text()).with_overrides(**overrides)
    watcher = ConfigWatcher(str(path), daemon.reload, initial=first, overrides=overrides)
    path.write_text("quota: {enabled: false}\nenforcement: {overLimitAction: evict}\n")
    assert watcher.check(force="test") is False
    assert watcher.current == first
    assert daemon.state.snapshot.config.enforcement.over_limit_action is OverLimitAction.EVENT
    api.access.allow_all()  # the component installed: the same file now applies
    assert watcher.check(force="test") is True
    assert daemon.state.snapshot.config.enforcement.over_limit_action is OverLimitAction.EVICT

"""Fixtures: a started double and a real ``kubernetes`` CoreV1Api pointed at it, both closed after."""
from __future__ import annotations

from typing import Iterator

import pytest
from kubernetes.client import ApiClient, CoreV1Api  # imported here: its lazy first import takes seconds

from standins.apiserver import ApiServerDouble
from vramshare.kube import api_client_for


@pytest.fixture
def double() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as api:
        yield api


@pytest.fixture
def v1(double: ApiServerDouble) -> Iterator[CoreV1Api]:
    http: ApiClient
    with api_client_for(double.url) as http:
        yield CoreV1Api(http)


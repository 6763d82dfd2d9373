"""Every test of this folder runs on test hosts (:mod:`gang.testing_hosts`): network namespaces on a
private bridge, made and removed by the tests. Where they cannot be made (not Linux, not root, no
``ip``), every test here is skipped with one line saying why."""

from __future__ import annotations

import pytest

from gang.testing import test_hosts_skip_reason

REASON = test_hosts_skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"test hosts: {REASON}")
    for item in items:
        if "tests/hosts/" in item.nodeid or "hosts/" in str(item.path):
            item.add_marker(skip)

"""Conformance tests against outside software. Tests marked ``real_vllm`` run only when asked for
explicitly with ``-m real_vllm`` (they need a vLLM CPU virtualenv; see scripts/real_vllm/)."""

import pytest


def pytest_collection_modifyitems(config, items):
    if "real_vllm" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="real-vLLM conformance runs only with `-m real_vllm`")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)

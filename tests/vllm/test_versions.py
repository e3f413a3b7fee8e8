"""The backend names the vLLM releases it is tested with, and warns on any other."""

import logging

import vllm

from kvxfer.integrations.vllm import SUPPORTED_VLLM
from kvxfer.integrations.vllm.connector import check_version


def test_the_installed_vllm_is_supported():
    assert check_version(vllm.__version__)


def test_an_untested_release_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
        assert not check_version("0.31.2") and not check_version("1.0.0")
    assert "vLLM 0.31.2 is untested" in caplog.text and all(v in caplog.text for v in SUPPORTED_VLLM)
    assert check_version("0.32.0") and check_version("0.33.1rc1")

"""AWS's shared credentials and config files, for the object tier's S3 store.

The store's own chain reads the environment (``AWS_ACCESS_KEY_ID``, ``AWS_WEB_IDENTITY_TOKEN_FILE``
with ``AWS_ROLE_ARN``, ...) and the instance or task role, but not the files ``aws configure``
writes. Where the environment names neither keys nor a web identity, the profile ``AWS_PROFILE``
(else ``default``) of ``AWS_SHARED_CREDENTIALS_FILE`` (else ``~/.aws/credentials``) is used, with
its region from ``AWS_CONFIG_FILE`` (else ``~/.aws/config``) when none is set.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

#: Variables with which the store's own chain finds credentials: the files are not read then.
CHAIN = ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
         "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
_KEYS = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
         "aws_session_token": "token"}


def _read(path: Path, section: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return {}
    return dict(parser[section]) if parser.has_section(section) else {}


def from_files(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """S3 store options (``access_key_id``, ``secret_access_key``, ``token``, ``region``) from the shared files,
    or nothing where the environment already leads the chain or no file has the profile."""
    env = os.environ if env is None else env
    if any(env.get(name) for name in CHAIN):
        return {}
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME") or "~").expanduser()
    found = _read(Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"), profile)
    options = {_KEYS[k]: v for k, v in found.items() if k in _KEYS and v}
    if "access_key_id" not in options or "secret_access_key" not in options:
        return {}
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        config = _read(Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"),
                       profile if profile == "default" else f"profile {profile}")
        if config.get("region"):
            options["region"] = config["region"]
    return options

"""Where the object tier's S3 credentials come from when the environment names none (issue 49)."""

from kvxfer.tiers.object.credentials import from_files


def _files(tmp_path) -> dict[str, str]:
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = A\naws_secret_access_key = S\n\n"
                                          "[other]\naws_access_key_id = B\naws_secret_access_key = T\n"
                                          "aws_session_token = X\n")
    (tmp_path / "config").write_text("[default]\nregion = eu-west-1\n\n[profile other]\nregion = ap-south-1\n")
    return {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config")}


def test_the_profile_s_keys_and_region_are_read(tmp_path):
    env = _files(tmp_path)
    assert from_files(env) == {"access_key_id": "A", "secret_access_key": "S", "region": "eu-west-1"}
    assert from_files({**env, "AWS_PROFILE": "other"}) == {"access_key_id": "B", "secret_access_key": "T",
                                                           "token": "X", "region": "ap-south-1"}
    assert from_files({**env, "AWS_REGION": "us-east-2"}) == {"access_key_id": "A", "secret_access_key": "S"}


def test_the_environment_s_chain_comes_first_and_a_missing_profile_or_file_gives_nothing(tmp_path):
    env = _files(tmp_path)
    assert from_files({**env, "AWS_ACCESS_KEY_ID": "E"}) == {}
    assert from_files({**env, "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"}) == {}
    assert from_files({**env, "AWS_PROFILE": "absent"}) == {}
    assert from_files({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "HOME": str(tmp_path)}) == {}
    (tmp_path / "credentials").write_text("not an ini file [")
    assert from_files(env) == {}

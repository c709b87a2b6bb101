"""The one address parser / formatter and the one token-file reader every part uses."""
import pytest

from kvtier.common.addresses import AddressError, format_address, parse_address, parse_daemon_address
from kvtier.common.tokens import TOKEN_FILE_BYTES_MAX, TokenFileError, read_token_file, token_matches


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7410", ("127.0.0.1", 7410)), ("[::1]:0", ("::1", 0)), ("node-a:1", ("node-a", 1)),
    (" host:65535 ", ("host", 65535)),
])
def test_parse_address(text, expected):
    assert parse_address(text) == expected
    assert parse_address(format_address(*expected)) == expected


@pytest.mark.parametrize("text, default, expected", [
    ("node-a", 7410, ("node-a", 7410)), ("::1", 7410, ("::1", 7410)), ("[::1]", 9, ("::1", 9)),
])
def test_default_port(text, default, expected):
    assert parse_address(text, default_port=default) == expected


@pytest.mark.parametrize("text, words", [
    ("host", "is not HOST:PORT"), (":5", "has no host"), ("h:x", "is not a number"),
    ("h:70000", "out of range"), ("[::1]x", "is not HOST:PORT"), ("", "has no host"),
])
def test_bad_addresses_name_the_setting(text, words):
    with pytest.raises(AddressError, match=words) as err:
        parse_address(text, what="listen")
    assert str(err.value).startswith("listen: ")


def test_a_daemon_address_has_a_port_to_dial():
    assert parse_daemon_address(" [::1]:7410 ", what="member") == ("::1", 7410)
    with pytest.raises(AddressError, match=r"member: 'h:0' has port 0, which is not a daemon's port"):
        parse_daemon_address("h:0", what="member")
    with pytest.raises(AddressError, match="is not HOST:PORT"):
        parse_daemon_address("h", what="member")


def test_format_brackets_ipv6_only():
    assert format_address("::1", 7410) == "[::1]:7410"
    assert format_address("10.0.0.1", 1) == "10.0.0.1:1"


def test_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret\n")
    assert read_token_file(str(path)) == "s3cret"
    for content, words in ((b"\n \n", "empty"), (b"\xff\xfe", "not UTF-8"),
                           (b"x" * (TOKEN_FILE_BYTES_MAX + 1), "longer than")):
        path.write_bytes(content)
        with pytest.raises(TokenFileError, match=words) as err:
            read_token_file(str(path))
        assert str(path) in str(err.value)
    with pytest.raises(TokenFileError, match="No such file"):
        read_token_file(str(tmp_path / "missing"))


def test_token_matches():
    assert token_matches(None, None) and token_matches("anything", None)
    assert token_matches("s3cret", "s3cret")
    assert not token_matches(None, "s3cret") and not token_matches("s3cres", "s3cret")
    assert not token_matches("", "s3cret")

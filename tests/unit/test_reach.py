"""A cache group's reach on the tiers other nodes read (``kvxfer.tiers.reach``): a token's group is named and
sealed by its token, under a name no group can take; the shared and node reaches change nothing they are given."""

from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.validate import POOL_ID_RE
from kvxfer.tiers.reach import NODE, SHARED, Reach, ReachKind

groups = st.from_regex(POOL_ID_RE, fullmatch=True)
tokens = st.binary(min_size=16, max_size=64)


@given(groups, tokens, tokens)
def test_a_tokens_group_has_a_name_no_group_can_take_and_another_token_another_name_and_key(group, one, two):
    a, b = Reach.of_token(group, one), Reach.of_token(group, two)
    assert a.kind is ReachKind.TOKEN and a == Reach.of_token(group, one)  # the same on every node
    assert not POOL_ID_RE.fullmatch(a.name(group)) and len(a.name(group)) == 33
    if one != two:
        assert a.name(group) != b.name(group) and a.secret(b"s") != b.secret(b"s")
    assert a.secret(b"") and a.secret(b"s") != a.secret(b"t") != b"t"  # sealed even without a tier secret


@given(groups, groups, tokens)
def test_one_token_names_two_groups_apart(one, two, token):
    if one != two:
        assert Reach.of_token(one, token).name(one) != Reach.of_token(two, token).name(two)


def test_the_shared_and_node_reaches_keep_the_name_and_secret():
    for reach in (SHARED, NODE):
        assert reach.name("g") == "g" and reach.secret(b"s") == b"s"
    assert "b'" not in repr(Reach.of_token("g", b"t" * 16))  # the derived key never in a log line

"""The connector's keys with tenants: a cache salt's tag survives every derivation, and
without tenants the keys are those the connector always had."""

from __future__ import annotations

from dataclasses import replace

import xxhash

from kvtier.connectors.vllm.groups import GroupLayout
from kvtier.connectors.vllm.keys import KeyScheme, rank_keys, rank_salt, request_extra
from kvtier.connectors.vllm.settings import ChunkShape
from kvtier.spec import KVSpec
from kvtier.store.quota import tenant_tag

SPEC = KVSpec(2, 2, 64, tp_size=2)
TOKS = list(range(64 * 5))


def test_tagged_keys_chain_the_same_whole_or_extended() -> None:
    scheme = KeyScheme("m", SPEC, 64, tenants=True)
    tag = scheme.tag("alice")
    assert tag == tenant_tag("alice") and scheme.tag(None) == tenant_tag("")
    whole = scheme.logical_keys(TOKS, request_extra(None, "alice"), tag=tag)
    head = scheme.logical_keys(TOKS[:128], request_extra(None, "alice"), tag=tag)
    tail = scheme.logical_keys(TOKS[128:], b"", parent=head[-1], tag=tag)
    assert whole == head + tail  # the save path extends from a tagged parent
    assert {k[:4] for k in whole} == {tag}
    assert len(set(whole)) == 5


def test_rank_and_group_keys_keep_the_tag_only_with_tenants() -> None:
    scheme = KeyScheme("m", SPEC, 64, tenants=True)
    logical = scheme.logical_keys(TOKS, tag=scheme.tag("bob"))
    salt = rank_salt(SPEC, 0, "page-123", tenants=True)
    ranked = rank_keys(salt, logical)
    assert {k[:4] for k in ranked} == {tenant_tag("bob")}
    other_rank = rank_keys(
        rank_salt(replace(SPEC, tp_rank=1), 0, "page-123", tenants=True), logical
    )
    assert not set(ranked) & set(other_rank)  # ranks still never share entries
    assert not set(ranked) & set(logical)

    shape = ChunkShape.of(64, 32)
    layout = GroupLayout.of(SPEC, shape, tenants=True)
    assert layout.key(logical[0], 0) == logical[0]
    g1, g2 = layout.key(logical[0], 1), layout.key(logical[0], 2)
    assert g1[:4] == g2[:4] == tenant_tag("bob") and len({logical[0], g1, g2}) == 3


def test_without_tenants_keys_are_unchanged() -> None:
    plain = KeyScheme("m", SPEC, 64)
    assert plain.tag("alice") == b""
    keys = plain.logical_keys(TOKS, request_extra(None, "alice"))
    assert keys == plain.logical_keys(TOKS, request_extra(None, "alice"), tag=b"")
    salt = rank_salt(SPEC, 0, "page-123")
    assert rank_keys(salt, keys) == [xxhash.xxh3_128_digest(salt + k) for k in keys]
    layout = GroupLayout.of(SPEC, ChunkShape.of(64, 32))
    assert layout.key(keys[0], 1) == xxhash.xxh3_128_digest(keys[0] + b"\0kvtier/group\0" + b"1")

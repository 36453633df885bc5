"""Msgids as an earlier SKMQ's store holds them (skmq/store/msgids.py): a uuid4 in hex
packed to 17 bytes reads back as the text it was; any other msgid stays text."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skmq.store.msgids import pack, split_held, unpack

APP = "ids"
NOW = 1_700_000_000_000


@pytest.mark.parametrize(
    "msgid", ["0123456789abcdef0123456789abcdef", "1f" * 16, "1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f00"]
)
def test_a_hex_uuid_packs_to_17_bytes_and_back(msgid: str) -> None:
    held = pack(msgid)
    assert held == b"\x00" + bytes.fromhex(msgid)
    assert unpack(held) == msgid
    assert split_held(held) == (held, b"")
    copy = held + b"\x1fr1"  # (a topic copy's delivery id as such a store held it)
    assert unpack(copy) == msgid + "\x1fr1"
    assert split_held(copy) == (held, b"\x1fr1")
    assert split_held(b"m1\x1fr1") == (b"m1", b"\x1fr1")


@pytest.mark.parametrize(
    "msgid",
    [
        "0123456789ABCDEF0123456789ABCDEF",  # upper case: would come back lower
        "0123456789abcdef 123456789abcdef",  # fromhex skips spaces
        "0123456789abcdef0123456789abcdeg",
        "0123456789abcdef0123456789abcde",
        "m1",
        "",
    ],
)
def test_any_other_msgid_stays_text(msgid: str) -> None:
    assert pack(msgid) == msgid.encode()
    assert unpack(msgid.encode()) == msgid


# what the broker takes as an id: no control character, valid UTF-8
IDS = st.characters(min_codepoint=0x20, exclude_characters="\x7f", exclude_categories=("Cs",))


@given(st.text(IDS, max_size=40))
def test_every_msgid_reads_back(msgid: str) -> None:
    assert unpack(pack(msgid)) == msgid


@given(st.uuids(version=4), st.text(IDS, max_size=8))
def test_every_uuid_delivery_id_reads_back(u: uuid.UUID, rid: str) -> None:
    assert unpack(pack(u.hex) + f"\x1f{rid}".encode()) == f"{u.hex}\x1f{rid}"

"""Tests of the frame codec (SPEC section 1)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skmq.codec import (
    PING,
    PONG,
    BareLineFeed,
    CodecError,
    Decoder,
    Frame,
    FrameTooLarge,
    InvalidFrame,
    LineTooLong,
    encode_frame,
    encode_resp,
)

Result = Frame | InvalidFrame

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_all(data: bytes, **limits: int) -> list[Result]:
    return Decoder(**limits).feed(data)


def decode_chunks(chunks: list[bytes], decoder: Decoder | None = None) -> list[Result]:
    decoder = decoder or Decoder()
    out: list[Result] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def cut(data: bytes, points: list[int]) -> list[bytes]:
    bounds = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in pairwise(bounds)]


def outcome(
    chunks: list[bytes], limits: dict[str, int], fast: bool = True
) -> tuple[list[Result], str]:
    """Frames decoded (including those attached to an error) and the error raised, if any."""
    decoder = Decoder(**limits)
    decoder._fast = fast
    out: list[Result] = []
    try:
        for chunk in chunks:
            out.extend(decoder.feed(chunk))
    except CodecError as exc:
        out.extend(exc.frames)
        return out, "error"
    return out, ""


# --- byte-exact examples --------------------------------------------------------------


def test_spec_push_example() -> None:
    data = b"msgid=id_xxx\r\ntype=push\r\ncontent=bytes_xxx\r\n\r\n"
    assert decode_all(data) == [Frame("push", {"msgid": "id_xxx"}, b"bytes_xxx")]
    assert encode_frame("push", {"msgid": "id_xxx"}, b"bytes_xxx") == data


def test_spec_ack_example_and_doubled_terminator() -> None:
    data = b"msgid=id_xxx\r\ntype=ack\r\n\r\n\r\n\r\n"
    decoder = Decoder()
    assert decoder.feed(data) == [Frame("ack", {"msgid": "id_xxx"})]
    assert decoder.buffered == 0
    assert encode_frame("ack", [("msgid", "id_xxx")]) == b"msgid=id_xxx\r\ntype=ack\r\n\r\n"


def test_original_producer_frame() -> None:
    data = b"appid=app\r\nmsgid=m1\r\ntype=queue\r\ncontent=hello world\r\n\r\n\r\n\r\n"
    frame = decode_all(data)[0]
    assert frame == Frame("queue", {"appid": "app", "msgid": "m1"}, b"hello world")
    assert isinstance(frame, Frame)
    assert frame.get("appid") == "app"
    assert frame.get("nope") is None
    assert frame.get("nope", "x") == "x"


def test_ping_pong() -> None:
    assert PING == b"ping\r\n\r\n"
    assert PONG == b"pong\r\n\r\n"
    assert decode_all(PING + PONG + PING) == [
        Frame("ping", {}),
        Frame("pong", {}),
        Frame("ping", {}),
    ]
    assert decode_chunks(bytewise(b"\r\n" + PING + b"\r\n\r\n")) == [Frame("ping", {})]


def test_ping_mixed_with_fields_is_invalid() -> None:
    frames = decode_all(b"ping\r\nmsgid=1\r\n\r\n" + PING)
    assert frames == [
        InvalidFrame("line without '=': b'ping'", {"msgid": "1"}),
        Frame("ping", {}),
    ]
    frames = decode_all(b"msgid=1\r\nping\r\n\r\n")
    assert frames == [InvalidFrame("line without '=': b'ping'", {"msgid": "1"})]


def test_invalid_frame_then_valid_frame_in_one_feed() -> None:
    data = b"msgid=m1\r\ngarbage\r\ntype=queue\r\ncontent=x\r\n\r\nmsgid=m2\r\ntype=ack\r\n\r\n"
    assert decode_all(data) == [
        InvalidFrame("line without '=': b'garbage'", {"msgid": "m1", "type": "queue"}),
        Frame("ack", {"msgid": "m2"}),
    ]


def test_empty_key_is_invalid() -> None:
    frames = decode_all(b"=oops\r\nmsgid=m\r\n\r\ntype=ack\r\n\r\n")
    assert frames == [InvalidFrame("empty key: b'=oops'", {"msgid": "m"}), Frame("ack", {})]


def test_key_is_everything_before_first_equals() -> None:
    frames = decode_all(b"a=b=c\r\ntype=t=u\r\ncontent=x=y\r\n\r\n")
    assert frames == [Frame("t=u", {"a": "b=c"}, b"x=y")]


def test_no_type_and_no_content() -> None:
    assert decode_all(b"msgid=1\r\n\r\n") == [Frame("", {"msgid": "1"}, None)]
    assert decode_all(b"content=\r\n\r\n") == [Frame("", {}, b"")]
    assert decode_all(b"type=\r\ncontent=\r\n\r\n") == [Frame("", {}, b"")]


def test_duplicates_overwrite() -> None:
    data = b"msgid=1\r\nmsgid=2\r\ntype=a\r\ntype=b\r\ncontent=x\r\ncontent=y\r\n\r\n"
    assert decode_all(data) == [Frame("b", {"msgid": "2"}, b"y")]


def test_fields_after_content_are_accepted() -> None:
    data = b"type=queue\r\ncontent=hello\r\nmsgid=m\r\nappid=a\r\n\r\n"
    assert decode_all(data) == [Frame("queue", {"msgid": "m", "appid": "a"}, b"hello")]


def test_unknown_keys_and_non_utf8_values() -> None:
    data = b"x_custom=\xff\xfe\r\nmsgid=\xc3\xa9\r\ntype=queue\r\ncontent=\xff\r\n\r\n"
    (frame,) = decode_all(data)
    assert isinstance(frame, Frame)
    assert frame.fields == {"x_custom": "\udcff\udcfe", "msgid": "é"}
    assert frame.content == b"\xff"
    # surrogateescape: the fields encode back to the same bytes
    assert encode_frame(frame.type, frame.fields, frame.content) == data


def test_content_keeps_lone_cr_and_lf() -> None:
    assert decode_all(b"content=a\rb\nc\r\r\n\r\n") == [Frame("", {}, b"a\rb\nc\r")]


def test_length_content_binary() -> None:
    body = b"a\r\n\r\nb\r\n"
    data = b"msgid=m\r\ntype=push\r\nlength=%d\r\ncontent=%b\r\n\r\n" % (len(body), body)
    assert encode_frame("push", {"msgid": "m"}, body) == data
    expected = [Frame("push", {"msgid": "m"}, body), Frame("ack", {})]
    assert decode_all(data + b"type=ack\r\n\r\n") == expected
    assert decode_chunks(bytewise(data + b"type=ack\r\n\r\n")) == expected


def test_length_zero() -> None:
    assert decode_all(b"length=0\r\ncontent=\r\n\r\n") == [Frame("", {}, b"")]


def test_length_not_followed_by_terminator_resyncs() -> None:
    data = b"msgid=m\r\nlength=2\r\ncontent=abc\r\n\r\ntype=ack\r\n\r\n"
    expected: list[Result] = [
        InvalidFrame("content of length=2 not followed by CRLF CRLF", {"msgid": "m"}),
        Frame("ack", {}),
    ]
    assert decode_all(data) == expected
    assert decode_chunks(bytewise(data)) == expected


@pytest.mark.parametrize("value", [b"abc", b"-1", b"+1", b" 1", b"", b"1.5", b"\xd9\xa1"])
def test_bad_length_is_invalid_and_content_read_up_to_crlf(value: bytes) -> None:
    data = b"msgid=m\r\nlength=" + value + b"\r\ncontent=ab\r\n\r\ntype=ack\r\n\r\n"
    frames = decode_all(data)
    assert len(frames) == 2
    assert isinstance(frames[0], InvalidFrame)
    assert frames[0].reason.startswith("invalid length")
    assert frames[0].fields == {"msgid": "m"}
    assert frames[1] == Frame("ack", {})


def test_blank_lines_between_frames() -> None:
    frame = b"type=ack\r\n\r\n"
    data = b"\r\n" + frame + b"\r\n\r\n\r\n" + frame + b"\r\n\r\n\r\n\r\n" + frame + b"\r\n"
    decoder = Decoder()
    assert decoder.feed(data) == [Frame("ack", {})] * 3
    assert decoder.buffered == 0


def test_partial_frame_is_buffered() -> None:
    decoder = Decoder()
    assert decoder.feed(b"msgid=1\r\ntype=ack\r\n") == []
    assert decoder.buffered == len(b"msgid=1\r\ntype=ack\r\n")
    assert decoder.feed(b"\r\nmsgid=2") == [Frame("ack", {"msgid": "1"})]
    assert decoder.buffered == len(b"msgid=2")
    assert decoder.feed(b"") == []


def test_bytes_like_input() -> None:
    data = b"type=ack\r\n\r\n"
    assert Decoder().feed(bytearray(data)) == [Frame("ack", {})]
    assert Decoder().feed(memoryview(data)) == [Frame("ack", {})]


# --- limits ---------------------------------------------------------------------------


def test_frame_too_large_without_any_crlf() -> None:
    decoder = Decoder(max_frame_bytes=1000, max_line_bytes=4096)
    decoder.feed(b"content=")
    with pytest.raises(FrameTooLarge):
        for _ in range(100):
            decoder.feed(b"x" * 100)
    assert decoder.buffered == 0
    with pytest.raises(FrameTooLarge):  # broken for good
        decoder.feed(b"type=ack\r\n\r\n")


def test_frame_too_large_endless_bytes_bounded_memory() -> None:
    decoder = Decoder()  # 1 MiB
    with pytest.raises(FrameTooLarge):
        for _ in range(1000):
            decoder.feed(b"content=" + b"y" * 65536)
            assert decoder.buffered <= 1 << 20


def test_frame_too_large_in_one_feed_keeps_earlier_frames() -> None:
    decoder = Decoder(max_frame_bytes=100)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(b"type=ack\r\n\r\ncontent=" + b"z" * 200 + b"\r\n\r\ntype=ack\r\n\r\n")
    assert info.value.frames == [Frame("ack", {})]
    with pytest.raises(FrameTooLarge) as again:
        decoder.feed(b"type=ack\r\n\r\n")
    assert again.value.frames == []


def test_frame_limit_counts_from_first_byte_to_terminator() -> None:
    frame = b"content=" + b"a" * 82 + b"\r\n\r\n"
    assert len(frame) == 94
    assert Decoder(max_frame_bytes=94).feed(b"\r\n\r\n\r\n" + frame) == [Frame("", {}, b"a" * 82)]
    with pytest.raises(FrameTooLarge):
        Decoder(max_frame_bytes=93).feed(frame)
    # the same, one byte at a time
    assert decode_chunks(bytewise(frame), Decoder(max_frame_bytes=94)) == [Frame("", {}, b"a" * 82)]
    with pytest.raises(FrameTooLarge):
        decode_chunks(bytewise(frame), Decoder(max_frame_bytes=93))


def test_length_over_frame_limit_raises_before_content_arrives() -> None:
    decoder = Decoder(max_frame_bytes=1000)
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"type=queue\r\nlength=5000\r\ncontent=abc")
    with pytest.raises(FrameTooLarge):
        Decoder().feed(b"length=" + b"9" * 30 + b"\r\ncontent=x\r\n\r\n")
    with pytest.raises(FrameTooLarge):  # beyond int()'s digit limit
        Decoder(max_line_bytes=10_000).feed(b"length=" + b"9" * 5000 + b"\r\ncontent=x\r\n\r\n")


@pytest.mark.parametrize(
    ("length", "shown"),
    [(b"2000", "length=2000"), (b"9" * 23, "a length= of over 18 digits")],
)
def test_a_length_over_the_frame_limit_is_refused_naming_it(length: bytes, shown: str) -> None:
    with pytest.raises(FrameTooLarge, match=f"^{shown} makes the frame too large$"):
        Decoder(max_frame_bytes=1000).feed(b"length=" + length + b"\r\ncontent=")


def test_huge_length_without_content_is_not_an_error() -> None:
    assert decode_all(b"length=99999999999\r\ntype=x\r\n\r\n") == [Frame("x", {})]


def test_long_header_line() -> None:
    with pytest.raises(LineTooLong):
        Decoder(max_line_bytes=100).feed(b"msgid=" + b"m" * 200 + b"\r\ntype=ack\r\n\r\n")
    decoder = Decoder(max_line_bytes=100)
    with pytest.raises(LineTooLong):  # detected while buffering
        decoder.feed(b"type=ack\r\nmsgid=" + b"m" * 200)
    with pytest.raises(LineTooLong):  # a line without "=" too
        Decoder(max_line_bytes=100).feed(b"g" * 101)
    with pytest.raises(LineTooLong):
        decode_chunks(bytewise(b"type=ack\r\nmsgid=" + b"m" * 101), Decoder(max_line_bytes=100))
    # exactly at the limit is fine
    line = b"msgid=" + b"m" * 94
    assert Decoder(max_line_bytes=100).feed(line + b"\r\n\r\n") == [Frame("", {"msgid": "m" * 94})]


def test_long_content_line_under_frame_limit() -> None:
    body = bytes(range(14, 256)) * 420  # ~100 KB, no CR/LF
    data = encode_frame("queue", {"appid": "a", "msgid": "m"}, body)
    assert b"length=" not in data
    expected = [Frame("queue", {"appid": "a", "msgid": "m"}, body)]
    assert decode_all(data) == expected
    assert decode_chunks([data[i : i + 1000] for i in range(0, len(data), 1000)]) == expected
    assert decode_chunks(bytewise(data)) == expected


def test_line_after_content_is_a_header_line() -> None:
    with pytest.raises(LineTooLong):
        Decoder(max_line_bytes=50).feed(b"content=x\r\nmsgid=" + b"m" * 60 + b"\r\n\r\n")


# --- bare LF (docs/PROTOCOL.md, section 1) ---------------------------------------------

LF_FRAME = b"type=queue\nappid=a\nmsgid=m\ncontent=hello\n\n"


def bare_lf(chunks: list[bytes], decoder: Decoder | None = None) -> list[Result]:
    """The frames completed before the BareLineFeed that `chunks` must raise."""
    decoder = decoder or Decoder()
    out: list[Result] = []
    with pytest.raises(BareLineFeed, match=r"^bare LF in a header line: lines end with CRLF") as e:
        for chunk in chunks:
            out.extend(decoder.feed(chunk))
    return out + e.value.frames


def test_a_frame_with_lf_line_endings_is_refused_at_its_first_line() -> None:
    assert bare_lf([LF_FRAME]) == []
    assert bare_lf(bytewise(LF_FRAME)) == []
    decoder = Decoder()
    assert bare_lf([b"type=queue\n"], decoder) == []  # at once, not at a terminator never sent
    with pytest.raises(BareLineFeed):  # broken for good, as for the limits
        decoder.feed(b"type=ack\r\n\r\n")


def test_frames_before_a_bare_lf_are_kept() -> None:
    data = b"type=ack\r\nmsgid=1\r\n\r\n" + LF_FRAME
    expected: list[Result] = [Frame("ack", {"msgid": "1"})]
    assert bare_lf([data]) == expected
    assert bare_lf(bytewise(data)) == expected
    assert bare_lf([data + b"type=ack\r\n\r\n"]) == expected  # a CRLF CRLF later changes nothing


@pytest.mark.parametrize(
    "data",
    [
        b"type=queue\r\nappid=a\nmsgid=m\r\n\r\n",  # inside a CRLF frame: no field holds a LF
        b"type=queue\r\n\nappid=a\r\n\r\n",  # a line made of a LF after a CRLF
        b"\ntype=ack\r\n\r\n",  # before a frame
        b"ping\n\n",
        b"content=x\r\nmsgid=m\n\r\n\r\n",  # a header line after the content
        b"length=3\ncontent=a\nb\r\n\r\n",
    ],
)
def test_a_bare_lf_in_any_header_line_is_refused(data: bytes) -> None:
    assert bare_lf([data]) == []
    assert bare_lf(bytewise(data)) == []
    slow = Decoder()
    slow._fast = False
    assert bare_lf([data], slow) == []


def test_lf_stays_legitimate_in_content_and_cr_alone_in_a_header() -> None:
    body = b"a\nb\n\nc\r\n\r\nd\n"
    cases = [
        (b"type=push\r\nlength=%d\r\ncontent=%b\r\n\r\n" % (len(body), body),
         Frame("push", {}, body)),
        # content without length=: raw bytes up to CRLF, a LF (even two) among them
        (b"type=queue\r\ncontent=a\nb\n\nc\r\n\r\n", Frame("queue", {}, b"a\nb\n\nc")),
        (b"type=queue\r\ncontent=x\n\r\nmsgid=m\r\n\r\n", Frame("queue", {"msgid": "m"}, b"x\n")),
        # a CR alone ends no line: part of the value, as before
        (b"type=ack\r\nx_note=a\rb\r\n\r\n", Frame("ack", {"x_note": "a\rb"})),
    ]  # fmt: skip
    for data, frame in cases:
        assert decode_all(data) == [frame]
        assert decode_chunks(bytewise(data)) == [frame]
        assert outcome([data], {}, fast=False) == ([frame], "")


# --- encoder --------------------------------------------------------------------------


def test_encode_resp_byte_exact() -> None:
    assert encode_resp("ack", "stored", "m1") == (
        b'msgid=m1\r\ntype=resp\r\ncontent={"status":"ack","content":"stored"}\r\n\r\n'
    )
    assert encode_resp("error", 'bad "json"\n') == (
        b'type=resp\r\ncontent={"status":"error","content":"bad \\"json\\"\\n"}\r\n\r\n'
    )
    assert encode_resp("reject", "d\u00e9j\u00e0 vu") == (
        'type=resp\r\ncontent={"status":"reject","content":"déjà vu"}\r\n\r\n'.encode()
    )


def test_encode_resp_matches_json_dumps_and_decodes() -> None:
    content = 'quote " backslash \\ tab \t nl \n cr \r ✓ \u2028'
    data = encode_resp("ack", content, "id\udcff")
    (frame,) = decode_all(data)
    assert isinstance(frame, Frame)
    assert frame.type == "resp"
    assert frame.fields == {"msgid": "id\udcff"}
    expected = json.dumps(
        {"status": "ack", "content": content}, ensure_ascii=False, separators=(",", ":")
    )
    assert frame.content == expected.encode()


def test_encode_resp_lone_surrogate_stays_valid_json() -> None:
    data = encode_resp("error", "bad msgid \udcff")
    (frame,) = decode_all(data)
    assert isinstance(frame, Frame) and frame.content is not None
    assert json.loads(frame.content) == {"status": "error", "content": "bad msgid \udcff"}


def test_encode_frame_layout() -> None:
    assert encode_frame("queue", {"appid": "a", "msgid": "m"}, b"hi") == (
        b"appid=a\r\nmsgid=m\r\ntype=queue\r\ncontent=hi\r\n\r\n"
    )
    assert encode_frame("queue", (), b"a\rb") == b"type=queue\r\nlength=3\r\ncontent=a\rb\r\n\r\n"
    assert encode_frame("register", (), b"") == b"type=register\r\ncontent=\r\n\r\n"


@pytest.mark.parametrize(
    ("type_", "fields"),
    [
        ("queue", {"msgid": "a\r\nb"}),
        ("queue", {"msgid": "a\nb"}),
        ("queue", {"msgid": "a\rb"}),
        ("queue", {"ms\ngid": "a"}),
        ("que\r\nue", {}),
        ("queue", {"": "a"}),
        ("queue", {"a=b": "a"}),
        ("queue", {"type": "a"}),
        ("queue", {"length": "1"}),
        ("queue", {"content": "x"}),
    ],
)
def test_encode_frame_rejects_bad_fields(type_: str, fields: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        encode_frame(type_, fields, b"x")


def test_encode_resp_rejects_crlf_in_msgid() -> None:
    with pytest.raises(ValueError):
        encode_resp("ack", "x", "a\nb")


# --- properties -----------------------------------------------------------------------

keys = st.from_regex(r"[a-z_]{1,10}", fullmatch=True).filter(
    lambda k: k not in ("type", "length", "content")
)
values = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\r\n"), max_size=20),
    st.binary(max_size=20)
    .map(lambda b: b.decode("utf-8", "surrogateescape"))
    .filter(lambda s: "\r" not in s and "\n" not in s),
)
types = st.one_of(
    st.sampled_from(["queue", "topic", "push", "resp", "ack", "arrived", "ping", "pong", ""]),
    values,
)
tricky = st.sampled_from(
    [b"\r\n\r\n", b"\r\n", b"\r", b"\n", b"x", b"content=", b"length=3\r\n", b"=", b"ping"]
)
contents = st.one_of(
    st.none(),
    st.binary(max_size=60),
    st.lists(tricky, max_size=8).map(b"".join),
)
frames_st = st.builds(Frame, types, st.dictionaries(keys, values, max_size=5), contents)
separators = st.sampled_from([b"", b"", b"\r\n\r\n", b"\r\n", b"\r\n\r\n\r\n"])


def encode(frame: Frame) -> bytes:
    return encode_frame(frame.type, frame.fields, frame.content)


@FAST
@given(st.lists(frames_st, max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
def test_roundtrip_any_chunking(frames: list[Frame], points: list[int]) -> None:
    data = b"".join(map(encode, frames))
    assert decode_all(data) == frames
    assert decode_chunks(cut(data, points)) == frames


@FAST
@given(st.lists(frames_st, max_size=4))
def test_roundtrip_one_byte_at_a_time(frames: list[Frame]) -> None:
    data = b"".join(map(encode, frames))
    decoder = Decoder()
    assert decode_chunks(bytewise(data), decoder) == frames
    assert decoder.buffered == 0


@FAST
@given(
    st.lists(st.tuples(separators, frames_st), max_size=6),
    separators,
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_roundtrip_with_blank_lines(
    items: list[tuple[bytes, Frame]], tail: bytes, points: list[int]
) -> None:
    data = b"".join(sep + encode(frame) for sep, frame in items) + tail
    frames = [frame for _, frame in items]
    assert decode_all(data) == frames
    assert decode_chunks(cut(data, points)) == frames
    assert decode_chunks(bytewise(data)) == frames


def with_lf_endings(data: bytes) -> bytes:
    return data.replace(b"\r\n", b"\n")


pieces = st.one_of(
    st.binary(max_size=30),
    frames_st.map(encode),
    frames_st.map(encode).map(with_lf_endings),
    st.sampled_from(
        [
            b"\r\n",
            b"\r\n\r\n",
            b"\r",
            b"\n",
            PING,
            b"ping\r\n",
            b"length=",
            b"length=3\r\n",
            b"length=-1\r\n",
            b"length=99999999\r\n",
            b"length=0\r\ncontent=",
            b"content=",
            b"=",
            b"a=b\r\n",
            b"type=ack\r\n\r\n",
            b"\xff\xfe=\xc3\r\n",
            b"x" * 45,
        ]
    ),
)
limits = st.sampled_from(
    [
        {},
        {"max_frame_bytes": 200, "max_line_bytes": 40},
        {"max_frame_bytes": 60, "max_line_bytes": 8},
        {"max_frame_bytes": 100, "max_line_bytes": 3},
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(pieces, max_size=12).map(b"".join),
    st.lists(st.integers(0, 10_000), max_size=12),
    limits,
)
def test_arbitrary_bytes_decode_the_same_however_chunked(
    data: bytes, points: list[int], limits: dict[str, int]
) -> None:
    """Only CodecError may escape, and chunking or the fast path never change the result."""
    whole = outcome([data], limits)
    assert outcome(cut(data, points), limits) == whole
    assert outcome(bytewise(data), limits) == whole
    assert outcome([data], limits, fast=False) == whole


@FAST
@given(st.binary(max_size=300), limits)
def test_random_binary_only_raises_codec_errors(data: bytes, limits: dict[str, int]) -> None:
    decoder = Decoder(**limits)
    try:
        decoder.feed(data)
        decoder.feed(data)
    except CodecError:
        pass
    assert decoder.buffered <= limits.get("max_frame_bytes", 1 << 20)


@FAST
@given(st.lists(frames_st, max_size=4), frames_st, st.lists(st.integers(0, 10_000), max_size=12))
def test_a_frame_with_lf_endings_after_good_ones_is_refused_however_chunked(
    good: list[Frame], bad: Frame, points: list[int]
) -> None:
    """Every frame the encoder writes starts with a header line (its fields, or type=):
    written with LF alone, it is refused with BareLineFeed, after the frames before it."""
    data = b"".join(map(encode, good)) + with_lf_endings(encode(bad))
    assert bare_lf([data]) == good
    assert bare_lf(cut(data, points)) == good
    assert bare_lf(bytewise(data)) == good

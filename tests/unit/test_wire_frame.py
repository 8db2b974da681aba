"""Unit tests of the sans-I/O frame codec (asyncrpc.protocol.wire.frame): no loop, no sockets."""

from __future__ import annotations

import array
import mmap
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrpc.errors import (
    FrameTooLargeError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from asyncrpc.protocol.wire import (
    MAGIC,
    PRELUDE_SIZE,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    bytearray_allocator,
    encode_frame,
)

# A small decoder configuration keeps byte-at-a-time tests fast while still crossing every
# boundary: staging smaller than the big parts, threshold smaller than staging.
STAGING = 1024
THRESHOLD = 256
CHUNKS = [1, 7, None]  # None: everything at once

Segments = list[tuple[bytes, str]]


class RecordingAllocator:
    """Allocator that remembers every call and the bytearray it handed out."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.buffers: list[bytearray] = []

    def __call__(self, nbytes: int, tag: str) -> tuple[object, memoryview]:
        self.calls.append((nbytes, tag))
        buf = bytearray(nbytes)
        self.buffers.append(buf)
        return buf, memoryview(buf)


def small_decoder(**kwargs: Any) -> FrameDecoder:
    return FrameDecoder(staging_size=STAGING, direct_threshold=THRESHOLD, **kwargs)


def wire_bytes(
    fields: Sequence[Any], payload: bytes, segments: Sequence[tuple[bytes, str]] = ()
) -> bytes:
    views = [(memoryview(data), tag) for data, tag in segments]
    return b"".join(bytes(piece) for piece in encode_frame(fields, payload, views))


def chunked(data: bytes, size: int | None) -> Iterator[bytes]:
    if size is None:
        yield data
        return
    for pos in range(0, len(data), size):
        yield data[pos : pos + size]


def feed_all(decoder: FrameDecoder, data: bytes, size: int | None) -> list[Frame]:
    frames: list[Frame] = []
    for chunk in chunked(data, size):
        frames += decoder.feed(chunk)
    return frames


def assert_frame(frame: Frame, fields: Sequence[Any], payload: bytes, segments: Segments) -> None:
    assert frame.fields == list(fields)
    assert bytes(frame.payload) == payload
    assert [bytes(s) for s in frame.segments] == [data for data, _ in segments]  # type: ignore[call-overload]
    assert frame.tags == [tag for _, tag in segments]


def raw_frame(
    header: bytes,
    payload: bytes = b"",
    buffers: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    buffers_len: int | None = None,
) -> bytes:
    """Build a frame by hand, so that every field can be wrong."""
    blen = len(buffers) if buffers_len is None else buffers_len
    prelude = struct.pack("!4sBBHIIQ", magic, version, flags, 0, len(header), len(payload), blen)
    return prelude + header + payload + buffers


CASES: dict[str, tuple[list[Any], bytes, Segments]] = {
    "no_segments": ([3, 12345, "mod.fn", None, 1.5, b"bin"], b"p" * 50, []),
    "empty_payload": ([1], b"", []),
    "segments": (
        [4, 7],
        b"pickle",
        [(b"abc", "cpu"), (b"", "cpu"), (bytes(range(256)) * 20, "cuda:0"), (b"z", "cpu")],
    ),
    "only_empty_segments": ([5], b"x", [(b"", "cpu"), (b"", "cuda:1")]),
    "large_payload": ([2, "big"], bytes(range(256)) * 12, []),  # 3072 > STAGING
    "payload_at_threshold": ([2], b"t" * THRESHOLD, []),
    "large_header": (["h" * 3000, list(range(100))], b"q" * 10, [(b"seg", "cpu")]),
}


# -- encode_frame ---------------------------------------------------------------------------


def test_encode_frame_pieces_are_header_then_uncopied_payload_and_segments() -> None:
    payload = bytearray(b"payload")
    seg = memoryview(bytearray(b"segment"))
    pieces = encode_frame([1, "a"], payload, [(seg, "cpu"), (memoryview(b""), "cpu")])
    assert len(pieces) == 3
    head = pieces[0]
    assert type(head) is bytes
    magic, version, flags, reserved, hlen, plen, blen = struct.unpack_from("!4sBBHIIQ", head)
    assert (magic, version, flags, reserved) == (MAGIC, PROTOCOL_VERSION, 0, 0)
    assert (len(head), plen, blen) == (PRELUDE_SIZE + hlen, len(payload), len(seg))
    assert msgpack.unpackb(head[PRELUDE_SIZE:]) == [1, "a", [[7, "cpu"], [0, "cpu"]]]
    assert isinstance(pieces[1], memoryview)
    assert pieces[1].obj is payload  # a view of the caller's bytearray, not a copy
    assert pieces[2] is seg


def test_encode_frame_passes_bytes_payload_itself() -> None:
    payload = b"a pickle"
    assert encode_frame([1], payload)[1] is payload


def test_encode_frame_skips_empty_payload() -> None:
    pieces = encode_frame([1], b"")
    assert len(pieces) == 1


def test_encode_frame_casts_non_byte_views() -> None:
    ints = array.array("i", [1, 2, 3])
    payload = memoryview(array.array("h", [7, 8]))
    pieces = encode_frame([0], payload, [(memoryview(ints), "cpu")])
    assert all(isinstance(p, memoryview) and p.format == "B" for p in pieces[1:])
    assert bytes(pieces[2]) == ints.tobytes()
    frames = FrameDecoder().feed(b"".join(bytes(p) for p in pieces))
    assert bytes(frames[0].payload) == payload.tobytes()
    assert bytes(frames[0].segments[0]) == ints.tobytes()  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("fields", "segments"),
    [
        pytest.param([object()], [], id="unpackable_field"),
        pytest.param([1 << 70], [], id="int_too_large"),
        pytest.param([1], [(memoryview(bytearray(8))[::2], "cpu")], id="non_contiguous"),
        pytest.param([1], [(memoryview(b"ab"), 5)], id="tag_not_str"),
    ],
)
def test_encode_frame_rejects_bad_input(fields: list[Any], segments: list[Any]) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(fields, b"", segments)


def test_encode_frame_rejects_payload_of_4gib() -> None:
    # Anonymous mmap pages are only reserved, never touched: this costs no real memory.
    with mmap.mmap(-1, 1 << 32) as huge:
        view = memoryview(huge)
        try:
            with pytest.raises(LocalProtocolError):
                encode_frame([1], view)
        finally:
            view.release()


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS, ids=["by1", "by7", "whole"])
@pytest.mark.parametrize("case", list(CASES))
def test_FrameDecoder_round_trips_in_chunks(case: str, chunk: int | None) -> None:
    fields, payload, segments = CASES[case]
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc)
    data = wire_bytes(fields, payload, segments)
    frames = feed_all(decoder, data, chunk)
    assert len(frames) == 1
    assert_frame(frames[0], fields, payload, segments)
    assert frames[0].nbytes == len(data)  # from the prelude, on every path
    assert alloc.calls == [(len(data), tag) for data, tag in segments]
    assert frames[0].segments == alloc.buffers
    assert decoder.at_frame_boundary()
    assert decoder.buffered == 0


@pytest.mark.parametrize("chunk", CHUNKS, ids=["by1", "by7", "whole"])
def test_FrameDecoder_returns_every_frame_of_one_feed(chunk: int | None) -> None:
    decoder = small_decoder()
    cases = list(CASES.values()) * 3
    data = b"".join(wire_bytes(*case) for case in cases)
    frames = feed_all(decoder, data, chunk)
    assert len(frames) == len(cases)
    for frame, (fields, payload, segments) in zip(frames, cases, strict=True):
        assert_frame(frame, fields, payload, segments)
        assert frame.nbytes == len(wire_bytes(fields, payload, segments))


def test_FrameDecoder_default_config_round_trips_large_parts() -> None:
    payload = bytes(range(256)) * 1200  # 300 KiB > default staging
    big = bytes(range(251)) * 400  # ~100 KB > default threshold
    fields = [9, "x" * 300_000]  # header > default staging
    segments = [(big, "cuda:0"), (b"", "cpu"), (b"s" * 100, "cpu")]
    data = wire_bytes(fields, payload, segments) * 2
    frames = feed_all(FrameDecoder(), data, 65_000)
    assert len(frames) == 2
    for frame in frames:
        assert_frame(frame, fields, payload, segments)


def test_FrameDecoder_many_small_frames_come_from_one_buffer_updated() -> None:
    decoder = FrameDecoder()
    one = wire_bytes([3, 1, "f"], b"x" * 50)
    data = one * 1000
    buf = decoder.get_buffer()
    assert len(buf) >= len(data)
    buf[: len(data)] = data
    frames = decoder.buffer_updated(len(data))
    assert len(frames) == 1000
    assert all(bytes(f.payload) == b"x" * 50 for f in frames)


def test_FrameDecoder_small_payload_is_an_owned_copy() -> None:
    decoder = small_decoder()
    frame = decoder.feed(wire_bytes([1], b"abc"))[0]
    decoder.feed(wire_bytes([2], b"zzz"))  # reuses the staging memory
    assert type(frame.payload) is bytes
    assert frame.payload == b"abc"


def test_FrameDecoder_frame_is_frozen() -> None:
    frame = small_decoder().feed(wire_bytes([1], b"abc"))[0]
    with pytest.raises(AttributeError):
        frame.payload = b""  # type: ignore[misc]
    assert frame == Frame([1], b"abc", [], [])


# -- the BufferedProtocol path --------------------------------------------------------------


def write_partially(decoder: FrameDecoder, data: bytes, step: int) -> tuple[list[Frame], set[int]]:
    """Drive get_buffer/buffer_updated, writing at most ``step`` bytes into each buffer.

    Returns the frames and the ids of the objects under the views handed out.
    """
    frames: list[Frame] = []
    owners: set[int] = set()
    pos = 0
    while pos < len(data):
        buf = decoder.get_buffer(-1)
        assert len(buf) > 0
        owners.add(id(buf.obj))
        n = min(step, len(buf) - 1 or 1, len(data) - pos)  # smaller than the view when we can
        buf[:n] = data[pos : pos + n]
        pos += n
        frames += decoder.buffer_updated(n)
    return frames, owners


def test_FrameDecoder_receives_big_segment_into_allocator_memory() -> None:
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc)
    big = bytes(range(256)) * 40  # 10 KiB, far above THRESHOLD
    frames, owners = write_partially(decoder, wire_bytes([1], b"p", [(big, "cuda:0")]), 1000)
    assert len(frames) == 1
    (segment,) = frames[0].segments
    assert segment is alloc.buffers[0]
    assert segment == big
    assert id(alloc.buffers[0]) in owners  # bytes were received straight into it


def test_FrameDecoder_direct_view_is_the_allocator_memory() -> None:
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc)
    big = b"\x5a" * 5000
    data = wire_bytes([1], b"", [(big, "cpu")])
    prefix = len(data) - len(big) + 10
    buf = decoder.get_buffer()
    buf[:prefix] = data[:prefix]
    assert decoder.buffer_updated(prefix) == []
    direct = decoder.get_buffer()
    assert direct.obj is alloc.buffers[0]
    assert len(direct) == len(big) - 10
    direct[:100] = data[prefix : prefix + 100]  # a partial write
    assert decoder.buffer_updated(100) == []
    direct = decoder.get_buffer()
    assert direct.obj is alloc.buffers[0]
    assert len(direct) == len(big) - 110
    direct[:] = data[prefix + 100 :]
    (frame,) = decoder.buffer_updated(len(direct))
    assert frame.segments[0] is alloc.buffers[0]
    assert frame.segments[0] == big


def test_FrameDecoder_receives_large_payload_into_its_own_bytearray() -> None:
    decoder = small_decoder()
    payload = bytes(range(256)) * 30
    frames, owners = write_partially(decoder, wire_bytes([1], payload), 500)
    (frame,) = frames
    assert type(frame.payload) is bytearray
    assert frame.payload == payload
    assert id(frame.payload) in owners


def test_FrameDecoder_never_replaces_its_staging_buffer() -> None:
    decoder = small_decoder()
    staging = decoder.get_buffer().obj
    data = b"".join(wire_bytes(*case) for case in CASES.values()) * 2
    _, owners = write_partially(decoder, data, 300)
    buffers = [decoder.get_buffer().obj]
    assert buffers[0] is staging
    assert id(staging) in owners


def test_FrameDecoder_staged_tail_is_compacted() -> None:
    # Frames of 37 bytes never align with the 64-byte staging buffer, so partial preludes
    # and payloads must keep moving to the front of it.
    decoder = FrameDecoder(staging_size=64, direct_threshold=32)
    frames_in = [([i], bytes([i]) * (i % 20)) for i in range(200)]
    data = b"".join(wire_bytes(f, p) for f, p in frames_in)
    frames, _ = write_partially(decoder, data, 1000)
    assert [(f.fields, f.payload) for f in frames] == [(f, p) for f, p in frames_in]


def test_FrameDecoder_buffered_counts_partial_frame() -> None:
    decoder = small_decoder()
    data = wire_bytes([1], b"p" * 2000, [(b"s" * 3000, "cpu")])
    feed_all(decoder, data[:-1], 100)
    assert decoder.buffered == len(data) - 1
    assert not decoder.at_frame_boundary()
    assert len(decoder.feed(data[-1:])) == 1
    assert decoder.buffered == 0
    assert decoder.at_frame_boundary()


def test_FrameDecoder_buffer_updated_rejects_more_than_the_buffer() -> None:
    decoder = small_decoder()
    buf = decoder.get_buffer()
    with pytest.raises(LocalProtocolError):
        decoder.buffer_updated(len(buf) + 1)
    with pytest.raises(LocalProtocolError):
        decoder.get_buffer()


def test_FrameDecoder_rejects_allocator_returning_wrong_size() -> None:
    def bad_alloc(nbytes: int, tag: str) -> tuple[object, memoryview]:
        return bytearray_allocator(nbytes + 1, tag)

    decoder = small_decoder(allocate=bad_alloc)
    with pytest.raises(LocalProtocolError):
        decoder.feed(wire_bytes([1], b"", [(b"abc", "cpu")]))


@pytest.mark.parametrize(("staging_size", "direct_threshold"), [(10, 5), (1024, 0), (1024, 2048)])
def test_FrameDecoder_rejects_inconsistent_sizes(staging_size: int, direct_threshold: int) -> None:
    with pytest.raises(ValueError, match="staging_size"):
        FrameDecoder(staging_size=staging_size, direct_threshold=direct_threshold)


# -- malformed input ------------------------------------------------------------------------

GOOD_HEADER = msgpack.packb([1, []])

MALFORMED: dict[str, bytes] = {
    "bad_magic": raw_frame(GOOD_HEADER, magic=b"HTTP"),
    "bad_version": raw_frame(GOOD_HEADER, version=PROTOCOL_VERSION + 1),
    "flags_set": raw_frame(GOOD_HEADER, flags=1),
    "header_not_msgpack": raw_frame(b"\xc1"),
    "header_truncated_msgpack": raw_frame(b"\x93\x01"),
    "header_extra_data": raw_frame(GOOD_HEADER + b"\x01"),
    "header_bad_utf8": raw_frame(b"\x92\xa2\xff\xfe\x90"),
    "header_unhashable_key": raw_frame(b"\x92\x81\x90\x01\x90"),
    "header_too_deep": raw_frame(b"\x91" * 5000 + b"\x90"),
    "header_empty": raw_frame(b""),
    "header_not_array": raw_frame(msgpack.packb({"a": []})),
    "header_empty_array": raw_frame(msgpack.packb([])),
    "segments_not_list": raw_frame(msgpack.packb([1, {"n": 3}]), buffers=b"abc"),
    "segment_not_pair": raw_frame(msgpack.packb([1, [[3]]]), buffers=b"abc"),
    "segment_triple": raw_frame(msgpack.packb([1, [[3, "cpu", 0]]]), buffers=b"abc"),
    "segment_size_not_int": raw_frame(msgpack.packb([1, [["3", "cpu"]]]), buffers=b"abc"),
    "segment_size_bool": raw_frame(msgpack.packb([1, [[True, "cpu"]]]), buffers=b"a"),
    "segment_tag_not_str": raw_frame(msgpack.packb([1, [[3, 0]]]), buffers=b"abc"),
    "segment_negative": raw_frame(msgpack.packb([1, [[-3, "cpu"], [6, "cpu"]]]), buffers=b"abc"),
    "segments_sum_below": raw_frame(msgpack.packb([1, [[2, "cpu"]]]), buffers=b"abc"),
    "segments_sum_above": raw_frame(msgpack.packb([1, [[4, "cpu"]]]), buffers=b"abc"),
    "segments_missing": raw_frame(msgpack.packb([1, []]), buffers=b"abc"),
}


@pytest.mark.parametrize("chunk", CHUNKS, ids=["by1", "by7", "whole"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_FrameDecoder_rejects_malformed_frame(case: str, chunk: int | None) -> None:
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc)
    with pytest.raises(RemoteProtocolError):
        feed_all(decoder, MALFORMED[case], chunk)
    assert alloc.calls == []
    assert not decoder.at_frame_boundary()


def test_FrameDecoder_error_names_bad_magic_and_versions() -> None:
    with pytest.raises(RemoteProtocolError, match="HTTP"):
        small_decoder().feed(MALFORMED["bad_magic"])
    theirs, ours = PROTOCOL_VERSION + 1, PROTOCOL_VERSION
    with pytest.raises(RemoteProtocolError, match=rf"version {theirs}\b.*\b{ours}\b"):
        small_decoder().feed(MALFORMED["bad_version"])


def test_FrameDecoder_reports_oversize_before_allocating() -> None:
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc, max_frame_size=1000)
    data = wire_bytes([1], b"p" * 100, [(b"s" * 2000, "cpu")])
    with pytest.raises(FrameTooLargeError) as info:
        decoder.feed(data[:PRELUDE_SIZE])  # the prelude alone is enough to refuse it
    assert info.value.limit == 1000
    assert info.value.size == len(data) - PRELUDE_SIZE
    assert alloc.calls == []


def test_FrameDecoder_refuses_huge_announced_sizes_without_allocating() -> None:
    alloc = RecordingAllocator()
    decoder = small_decoder(allocate=alloc)
    prelude = struct.pack("!4sBBHIIQ", MAGIC, PROTOCOL_VERSION, 0, 0, 10, 0xFFFFFFFF, (1 << 64) - 1)
    with pytest.raises(FrameTooLargeError):
        decoder.feed(prelude)
    assert alloc.calls == []


def test_FrameDecoder_refuses_header_over_its_limit() -> None:
    decoder = small_decoder(max_header_size=100)
    with pytest.raises(RemoteProtocolError):
        decoder.feed(wire_bytes(["h" * 200], b"")[:PRELUDE_SIZE])


def test_FrameDecoder_truncated_stream_yields_no_frame() -> None:
    data = wire_bytes(*CASES["segments"])
    for cut in (1, PRELUDE_SIZE, PRELUDE_SIZE + 3, len(data) - 1):
        decoder = small_decoder()
        assert decoder.feed(data[:cut]) == []
        assert not decoder.at_frame_boundary()
        assert decoder.buffered == cut


@pytest.mark.parametrize("case", ["bad_magic", "header_not_msgpack", "segments_sum_below"])
def test_FrameDecoder_stays_broken_after_an_error(case: str) -> None:
    decoder = small_decoder()
    good = wire_bytes([1], b"ok")
    with pytest.raises(RemoteProtocolError) as first:
        decoder.feed(good + MALFORMED[case])
    for call in (
        lambda: decoder.feed(good),
        decoder.get_buffer,
        lambda: decoder.buffer_updated(0),
        lambda: decoder.feed(b""),
    ):
        with pytest.raises(RemoteProtocolError) as again:
            call()
        assert type(again.value) is type(first.value)
        assert again.value.__cause__ is first.value
    assert not decoder.at_frame_boundary()


def test_FrameDecoder_stays_broken_after_oversize() -> None:
    decoder = small_decoder(max_frame_size=10)
    with pytest.raises(FrameTooLargeError):
        decoder.feed(wire_bytes([1], b"p" * 20))
    with pytest.raises(FrameTooLargeError) as again:
        decoder.feed(wire_bytes([1], b""))
    assert again.value.limit == 10


def test_FrameDecoder_errors_are_protocol_errors() -> None:
    assert issubclass(FrameTooLargeError, RemoteProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


# -- property -------------------------------------------------------------------------------

field_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=10,
)
segment_lists = st.lists(
    st.tuples(st.binary(max_size=700), st.sampled_from(["cpu", "cuda:0", "meta", ""])),
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(
    frames_in=st.lists(
        st.tuples(st.lists(field_values, max_size=5), st.binary(max_size=1500), segment_lists),
        min_size=1,
        max_size=4,
    ),
    staging_size=st.integers(min_value=PRELUDE_SIZE, max_value=600),
    threshold_fraction=st.floats(min_value=0.0, max_value=1.0),
    cuts=st.lists(st.integers(min_value=1, max_value=900), max_size=30),
)
def test_FrameDecoder_property_round_trip(
    frames_in: list[tuple[list[Any], bytes, Segments]],
    staging_size: int,
    threshold_fraction: float,
    cuts: list[int],
) -> None:
    threshold = max(1, int(staging_size * threshold_fraction))
    decoder = FrameDecoder(staging_size=staging_size, direct_threshold=threshold)
    data = b"".join(wire_bytes(*frame) for frame in frames_in)
    frames: list[Frame] = []
    pos = 0
    for cut in cuts:
        frames += decoder.feed(data[pos : pos + cut])
        pos += cut
    frames += decoder.feed(data[pos:])
    assert len(frames) == len(frames_in)
    for frame, (fields, payload, segments) in zip(frames, frames_in, strict=True):
        assert_frame(frame, fields, payload, segments)
    assert decoder.at_frame_boundary()


def test_FrameDecoder_stepwise_returns_one_frame_until_opened() -> None:
    data = wire_bytes([1], b"") + wire_bytes([2], b"") + wire_bytes([3], b"x" * 5000)
    decoder = FrameDecoder(max_frame_size=4096, max_header_size=4096, stepwise=True)
    first = decoder.feed(data[: len(data) - 5000 - 1])  # the big frame is not complete yet
    assert [f.fields for f in first] == [[1]]
    assert [f.fields for f in decoder.buffer_updated(0)] == [[2]]
    decoder.open(max_frame_size=1 << 20)
    rest = decoder.feed(data[len(data) - 5000 - 1 :])
    assert [(f.fields, bytes(f.payload)) for f in rest] == [([3], b"x" * 5000)]


def test_FrameDecoder_stepwise_limits_refuse_a_big_frame() -> None:
    decoder = FrameDecoder(max_frame_size=4096, max_header_size=4096, stepwise=True)
    with pytest.raises(FrameTooLargeError):
        decoder.feed(wire_bytes([1], b"x" * 10_000))

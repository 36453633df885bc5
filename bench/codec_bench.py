"""Throughput of the frame codec on the broker's hot path.

Usage: python -m bench.codec_bench [--frames N] [--repeat R]

Frames are `queue` frames (appid, msgid, type, 100-byte content) as a producer
sends them, with the original's doubled terminator. Decoding is measured with the
stream fed in 64 KiB chunks and with one frame per feed() call; encoding with
encode_frame and encode_resp. Each figure is the best of R runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from skmq.codec import Decoder, encode_frame, encode_resp

CHUNK = 64 * 1024
CONTENT = bytes(range(48, 48 + 50)) * 2  # 100 bytes, no CR/LF


def make_frames(n: int) -> list[bytes]:
    """n producer frames, each followed by the extra terminator the original writes."""
    return [
        encode_frame("queue", {"appid": "app-1", "msgid": f"msg-{i:012d}"}, CONTENT) + b"\r\n\r\n"
        for i in range(n)
    ]


def best_rate(n: int, repeat: int, run: Callable[[], int]) -> float:
    """Frames per second of the fastest of `repeat` runs; run() returns frames handled."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = run()
        elapsed = time.perf_counter() - t0
        if got != n:
            raise SystemExit(f"handled {got} frames, expected {n}")
        best = max(best, n / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n: int = args.frames
    repeat: int = args.repeat

    frames = make_frames(n)
    stream = b"".join(frames)
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]

    def decode_chunks() -> int:
        feed = Decoder().feed
        return sum(len(feed(chunk)) for chunk in chunks)

    def decode_one_by_one() -> int:
        feed = Decoder().feed
        return sum(len(feed(frame)) for frame in frames)

    fields = {"appid": "app-1", "msgid": "msg-000000000042"}

    def encode() -> int:
        for _ in range(n):
            encode_frame("queue", fields, CONTENT)
        return n

    def encode_answer() -> int:
        for _ in range(n):
            encode_resp("ack", "stored", "msg-000000000042")
        return n

    print(f"{n} frames of {len(frames[0])} bytes (100-byte content), best of {repeat}")
    print(f"decode, 64 KiB chunks  : {best_rate(n, repeat, decode_chunks):>12,.0f} frames/s")
    print(f"decode, 1 frame a feed : {best_rate(n, repeat, decode_one_by_one):>12,.0f} frames/s")
    print(f"encode_frame           : {best_rate(n, repeat, encode):>12,.0f} frames/s")
    print(f"encode_resp            : {best_rate(n, repeat, encode_answer):>12,.0f} frames/s")


if __name__ == "__main__":
    main()

"""The corpus reader: LZW segments, the EC02 container, the .deb, chapters, split.

A test-side `compress`-format encoder writes the inputs, so the whole path from a
.deb to the split corpus runs without the network; the real package is read only
when `ATOM_KJV_DEB` names it.
"""

from __future__ import annotations

import io
import lzma
import os
import random
import struct
import tarfile
from pathlib import Path

import pytest

from tools import corpus


def lzw_compress(data: bytes, max_bits: int = 16, clear_after: int | None = None):
    """Unix compress, block mode, without its header: 8-code groups padded at every
    width change. `clear_after` emits a clear code after that many codes."""
    bits: list[tuple[int, int]] = []  # (code, width)
    table = {bytes([i]): i for i in range(256)}
    next_code, width, group_start = 257, 9, 0
    codes_written = 0

    def emit(code: int) -> None:
        nonlocal codes_written
        bits.append((code, width))
        codes_written += 1

    def pad_group() -> None:
        nonlocal group_start
        written = len(bits) - group_start
        bits.extend([(0, width)] * ((-written) % 8))
        group_start = len(bits)

    current = b""
    for value in data:
        candidate = current + bytes([value])
        if candidate in table:
            current = candidate
            continue
        emit(table[current])
        if clear_after is not None and codes_written == clear_after:
            emit(256)
            pad_group()
            table = {bytes([i]): i for i in range(256)}
            next_code, width = 257, 9
            current = bytes([value])
            continue
        if next_code < 1 << max_bits:
            table[candidate] = next_code
            next_code += 1
        # The reader widens once the entry it will define next no longer fits.
        if next_code > (1 << width) and width < max_bits:
            pad_group()
            width += 1
        current = bytes([value])
    if current:
        emit(table[current])
    stream, position = 0, 0
    for code, code_width in bits:
        stream |= code << position
        position += code_width
    return stream.to_bytes((position + 7) // 8, "little")


def verse_text(chapters: dict[tuple[str, int], list[str]]) -> str:
    lines = ["Holy Bible, a test edition."]
    for (book, number), verses in chapters.items():
        lines += [f"{book}{number}:{i} {v}" for i, v in enumerate(verses, start=1)]
    return "\n".join(lines) + "\n"


def ec02(text: bytes, segment_size: int) -> bytes:
    segments = [
        lzw_compress(text[i : i + segment_size])
        for i in range(0, len(text), segment_size)
    ]
    header = bytearray(b"EC02Compressed Data File".ljust(0x54, b"\0"))
    header += struct.pack(">II", segment_size, len(segments))
    first = len(header) + 4 * (len(segments) + 1) + 3
    offsets = [first]
    for segment in segments:
        offsets.append(offsets[-1] + len(segment))
    header += struct.pack(f">{len(offsets)}I", *offsets)
    return bytes(header) + b"\x1f\x9d\x90" + b"".join(segments)


def ar_member(name: str, body: bytes) -> bytes:
    head = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(body):<10}`\n".encode()
    return head + body + (b"\n" if len(body) % 2 else b"")


def fake_deb(path: Path, data: bytes) -> Path:
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        info = tarfile.TarInfo("./usr/lib/bible.data")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path.write_bytes(
        b"!<arch>\n"
        + ar_member("debian-binary", b"2.0\n")
        + ar_member("data.tar.xz", lzma.compress(tar_bytes.getvalue()))
    )
    return path


def prose(rng: random.Random, words: int) -> str:
    vocabulary = "and the LORD said unto Moses thee thou hast of Israel, children; ."
    return " ".join(rng.choice(vocabulary.split()) for _ in range(words))


@pytest.mark.parametrize("clear_after", [None, 700])
def test_lzw_round_trip_across_code_widths(clear_after):
    rng = random.Random(0)
    # Varied enough to define > 2048 entries: widths 9 -> 12.
    data = bytes(rng.choice(b"abcdefghij ,.") for _ in range(30_000))
    packed = lzw_compress(data, clear_after=clear_after)
    assert corpus.lzw_decompress(packed, 16) == data
    # A small table limit freezes the table at 2**10 entries.
    assert corpus.lzw_decompress(lzw_compress(data, max_bits=10), 10) == data


def test_lzw_rejects_an_undefined_code():
    bad = (300).to_bytes(2, "little")  # a 9-bit code 300 with nothing defined
    with pytest.raises(ValueError, match="undefined"):
        corpus.lzw_decompress(bad, 16)


def test_deb_to_split_corpus(tmp_path):
    rng = random.Random(1)
    books = [("Ge", n) for n in range(1, 60)] + [("Rev", n) for n in range(1, 4)]
    chapters = {key: [prose(rng, 12) for _ in range(3)] for key in books}
    text = verse_text(chapters).encode()
    deb = fake_deb(tmp_path / "bible-kjv-text_0_all.deb", ec02(text, 4096))
    loaded = corpus.load_corpus(deb)
    parsed = loaded.train + loaded.held_out
    assert len(parsed) == len(books)
    held = [c for i, c in enumerate(books) if i % 50 == 25]
    assert [(c.book, c.number) for c in loaded.held_out] == held
    first = loaded.train[0]
    assert (first.book, first.number, first.verses) == (
        "Ge",
        1,
        tuple(chapters["Ge", 1]),
    )
    assert first.text == " ".join(chapters["Ge", 1])
    assert not any(":" in v.split()[0] for c in parsed for v in c.verses)


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="EC02"):
        corpus.unpack_bible_data(b"not a container")
    with pytest.raises(ValueError, match="not a verse"):
        corpus.parse_chapters("title\nGe1:1 fine\nstray line\n")
    not_deb = tmp_path / "x.deb"
    not_deb.write_bytes(b"hello")
    with pytest.raises(ValueError, match="ar signature"):
        corpus.load_corpus(not_deb)


def test_shipped_excerpt_is_the_held_out_split():
    excerpt = corpus.load_excerpt()
    chapters = excerpt.train + excerpt.held_out
    assert len(chapters) == 24
    assert corpus.held_out_text(chapters) == corpus.HELD_OUT_FILE.read_text()
    assert chapters[0].verses[0].startswith("And there was a famine in the land")


@pytest.mark.skipif(
    not os.environ.get("ATOM_KJV_DEB"), reason="set ATOM_KJV_DEB to the real .deb"
)
def test_real_package_gives_the_shipped_excerpt():
    loaded = corpus.load_corpus(os.environ["ATOM_KJV_DEB"])
    assert (len(loaded.train), len(loaded.held_out)) == (1165, 24)
    assert corpus.held_out_text(loaded.held_out) == corpus.HELD_OUT_FILE.read_text()

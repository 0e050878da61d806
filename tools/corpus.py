"""The tiny models' corpus: the King James Bible as clean prose, split by chapter.

Source: Debian's `bible-kjv-text` package (the 1611 translation, public domain),
fetched with `apt-get download bible-kjv-text` or given as a path. The package keeps
the text in `usr/lib/bible.data` inside its `data.tar.xz`: an "EC02" container whose
big-endian header holds, at 0x54, the uncompressed segment size (64 KiB), at 0x58
the segment count n and at 0x5c n + 1 file offsets. Each segment is a Unix
`compress` stream (LZW, block mode) without its 3-byte header; one copy of that
header sits just before the first segment. The text is one verse a line,
`Ge1:1 In the beginning ...`, after a title line.

Prose: a chapter is one document, its verses joined by spaces with the book /
chapter:verse markers stripped. Every `HELD_OUT_EVERY`-th chapter (from
`HELD_OUT_OFFSET`) is held out from training; `atom/models/tiny/assets/kjv_heldout.txt`
ships those chapters, one verse a line and a blank line between chapters.

    python -m tools.corpus --deb bible-kjv-text_4.38_all.deb --write-held-out PATH
"""

from __future__ import annotations

import argparse
import io
import lzma
import re
import struct
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from atom.models.tiny.excerpt import HELD_OUT_FILE
from atom.utils.arithmetic import ceil_div

PACKAGE = "bible-kjv-text"
DATA_MEMBER = "usr/lib/bible.data"
HELD_OUT_EVERY = 50
HELD_OUT_OFFSET = 25

_CONTAINER_MAGIC = b"EC02"
_COMPRESS_MAGIC = b"\x1f\x9d"
_LZW_CLEAR = 256
_LZW_FIRST_WIDTH = 9
_VERSE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.+)$")


@dataclass(frozen=True)
class Chapter:
    book: str
    number: int
    verses: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.verses)


@dataclass(frozen=True)
class Corpus:
    train: list[Chapter]
    held_out: list[Chapter]


def lzw_decompress(data: bytes, max_bits: int) -> bytes:
    """Decode a Unix `compress` code stream (block mode, header removed).

    Codes are little-endian bit fields, 9 bits wide at first. The encoder writes
    them in groups of 8, each group n_bits bytes long, and pads the open group
    whenever the width changes (a new width, or a clear code): so does the reader.
    """
    padded = data + b"\0\0\0"
    total_bits = len(data) * 8
    max_entries = 1 << max_bits
    # Entry 256 is the clear code's; reading the first code after a clear appends
    # a placeholder there, which keeps the indices in step with the encoder.
    table = [bytes([i]) for i in range(256)] + [b""]
    out: list[bytes] = []
    previous: bytes | None = None
    width, width_start, pos = _LZW_FIRST_WIDTH, 0, 0

    def end_of_group() -> int:
        group = width * 8
        return width_start + ceil_div(pos - width_start, group) * group

    while True:
        if len(table) >= 1 << width and width < max_bits:
            pos = width_start = end_of_group()
            width += 1
        if pos + width > total_bits:
            break
        byte = pos >> 3
        field = int.from_bytes(padded[byte : byte + 3], "little") >> (pos & 7)
        code = field & ((1 << width) - 1)
        pos += width
        if code == _LZW_CLEAR:
            pos = width_start = end_of_group()
            width = _LZW_FIRST_WIDTH
            del table[256:]
            continue
        if code < len(table):
            entry = table[code]
            if previous is not None and len(table) < max_entries:
                table.append(previous + entry[:1])
        elif code == len(table) and previous is not None:
            entry = previous + previous[:1]  # the string being defined right now
            table.append(entry)
        else:
            raise ValueError(f"LZW code {code} at bit {pos - width} is undefined")
        out.append(entry)
        previous = entry
    return b"".join(out)


def unpack_bible_data(blob: bytes) -> str:
    """The plain text of an EC02 container (`usr/lib/bible.data`)."""
    if not blob.startswith(_CONTAINER_MAGIC):
        raise ValueError(f"not an EC02 container: starts with {blob[:8]!r}")
    segment_size, count = struct.unpack(">II", blob[0x54:0x5C])
    offsets = struct.unpack(f">{count + 1}I", blob[0x5C : 0x5C + 4 * (count + 1)])
    header = blob[offsets[0] - 3 : offsets[0]]
    if header[:2] != _COMPRESS_MAGIC or not header[2] & 0x80:
        raise ValueError(f"expected a block-mode compress header, got {header!r}")
    if offsets[-1] != len(blob):
        raise ValueError(f"segments end at {offsets[-1]}, the file at {len(blob)}")
    max_bits = header[2] & 0x1F
    segments = []
    for i in range(count):
        segment = lzw_decompress(blob[offsets[i] : offsets[i + 1]], max_bits)
        if i < count - 1 and len(segment) != segment_size:
            raise ValueError(
                f"segment {i} holds {len(segment)} bytes, not {segment_size}"
            )
        segments.append(segment)
    return b"".join(segments).decode("ascii")


def read_deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb: an `ar` archive whose data.tar.xz holds the files."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb} is not a Debian package (no ar signature)")
    pos = 8
    while pos + 60 <= len(raw):
        name = raw[pos : pos + 16].decode().strip().rstrip("/")
        size = int(raw[pos + 48 : pos + 58])
        body = raw[pos + 60 : pos + 60 + size]
        pos += 60 + size + size % 2
        if name == "data.tar.xz":
            with tarfile.open(fileobj=io.BytesIO(lzma.decompress(body))) as tar:
                for info in tar.getmembers():
                    if info.name.lstrip("./") == member:
                        return tar.extractfile(info).read()
            raise ValueError(f"{deb} has no {member}")
    raise ValueError(f"{deb} has no data.tar.xz member")


def download_deb(folder: Path) -> Path:
    """`apt-get download bible-kjv-text` into `folder`; the .deb it wrote."""
    try:
        subprocess.run(
            ["apt-get", "download", PACKAGE],
            cwd=folder,
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(
            f"could not `apt-get download {PACKAGE}` ({err}); download it elsewhere "
            "and pass its path (--corpus-deb)"
        ) from err
    debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download wrote no {PACKAGE}_*.deb")
    return debs[-1]


def parse_chapters(text: str) -> list[Chapter]:
    """Chapters in book order from the verse-per-line text (title line skipped)."""
    chapters: list[Chapter] = []
    current: tuple[str, int] | None = None
    verses: list[str] = []
    for line_number, line in enumerate(text.splitlines()[1:], start=2):
        match = _VERSE.match(line)
        if match is None:
            raise ValueError(f"line {line_number} is not a verse: {line[:60]!r}")
        key = (match.group(1), int(match.group(2)))
        if key != current:
            if current is not None:
                chapters.append(Chapter(*current, tuple(verses)))
            current, verses = key, []
        verses.append(" ".join(match.group(4).split()))
    if current is not None:
        chapters.append(Chapter(*current, tuple(verses)))
    return chapters


def split(chapters: list[Chapter]) -> Corpus:
    held = {i for i in range(len(chapters)) if i % HELD_OUT_EVERY == HELD_OUT_OFFSET}
    return Corpus(
        train=[c for i, c in enumerate(chapters) if i not in held],
        held_out=[c for i, c in enumerate(chapters) if i in held],
    )


def load_corpus(deb: str | Path | None = None) -> Corpus:
    """The split corpus from `deb` (a bible-kjv-text .deb), else a fresh download."""
    if deb is not None:
        blob = read_deb_member(Path(deb), DATA_MEMBER)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            blob = read_deb_member(download_deb(Path(tmp)), DATA_MEMBER)
    return split(parse_chapters(unpack_bible_data(blob)))


def load_excerpt(path: str | Path = HELD_OUT_FILE) -> Corpus:
    """A corpus from a file in the excerpt format (the shipped one by default), for
    quick runs without the package: its last chapter held out, the rest to train."""
    blocks = Path(path).read_text(encoding="utf-8").strip().split("\n\n")
    chapters = [
        Chapter("excerpt", i + 1, tuple(block.splitlines()))
        for i, block in enumerate(blocks)
    ]
    if len(chapters) < 2:
        raise ValueError(f"{path} holds {len(chapters)} chapter(s); at least 2 needed")
    return Corpus(train=chapters[:-1], held_out=chapters[-1:])


def held_out_text(chapters: list[Chapter]) -> str:
    """The shipped excerpt's format: a verse a line, chapters apart by a blank line."""
    return "\n\n".join("\n".join(c.verses) for c in chapters) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deb", help=f"a {PACKAGE} .deb (default: apt-get download)")
    parser.add_argument("--write-held-out", metavar="PATH", help="write the excerpt")
    args = parser.parse_args(argv)
    corpus = load_corpus(args.deb)
    for label, chapters in (("train", corpus.train), ("held-out", corpus.held_out)):
        words = sum(len(c.text.split()) for c in chapters)
        print(f"{label}: {len(chapters)} chapters, {words} words")
    if args.write_held_out:
        Path(args.write_held_out).write_text(held_out_text(corpus.held_out))


if __name__ == "__main__":
    main()

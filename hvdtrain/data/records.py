"""TFRecord framing, checked without TensorFlow: count a file's records and find where it is
damaged.

A TFRecord file is a sequence of records, each ``length`` (8 bytes, little-endian),
``masked CRC-32C of length`` (4), ``payload`` (length bytes), ``masked CRC-32C of payload`` (4).
TensorFlow's reader raises on a cut inside a payload, but takes a file that ends inside a
header for a clean end of file: training would silently run on fewer records (padded up to the
planned count). So files are scanned here before training: every header is read and its CRC
checked, and every payload must fit in the file. Payload CRCs are left to TensorFlow's reader
(checking them here would read every byte of the dataset before the first step).
"""

from __future__ import annotations

import struct
from pathlib import Path

HEADER_BYTES = 12
FOOTER_BYTES = 4
_CASTAGNOLI = 0x82F63B78
_MASK_DELTA = 0xA282EAD8


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CASTAGNOLI if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def masked_crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, masked as TFRecord stores it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


class DamagedRecordFile(Exception):
    """Where and how a TFRecord file is damaged (the message reads after the file's name)."""


def count_records(path: str | Path) -> int:
    """The number of records in a TFRecord file; DamagedRecordFile when a header is corrupt
    or the file ends inside a record (header, payload or footer)."""
    size = Path(path).stat().st_size
    count = offset = 0
    with open(path, "rb") as handle:
        while offset < size:
            header = handle.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                raise DamagedRecordFile(f"ends inside the header of record {count + 1} (byte "
                                        f"{offset} of {size}): the file is truncated")
            length, crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != crc:
                raise DamagedRecordFile(f"record {count + 1} has a corrupt header (byte "
                                        f"{offset}): it is not a TFRecord file, or it is damaged")
            offset += HEADER_BYTES + length + FOOTER_BYTES
            if offset > size:
                raise DamagedRecordFile(f"ends inside record {count + 1} ({size} bytes, the "
                                        f"record needs {offset}): the file is truncated")
            handle.seek(offset)
            count += 1
    return count


def damaged_record_at(files: list[str], offset: int) -> tuple[str, int] | None:
    """(file, record number) of the record whose payload, at byte ``offset``, fails its
    checksum, in the first of ``files`` that has one: TensorFlow's reader names that offset,
    not the file."""
    start = offset - HEADER_BYTES
    for name in files:
        try:
            with open(name, "rb") as handle:
                handle.seek(start)
                header = handle.read(HEADER_BYTES)
                if len(header) < HEADER_BYTES:
                    continue
                length, crc = struct.unpack("<QI", header)
                if masked_crc32c(header[:8]) != crc:
                    continue
                payload = handle.read(length)
                footer = handle.read(FOOTER_BYTES)
        except OSError:
            continue
        if len(footer) == FOOTER_BYTES and \
                masked_crc32c(payload) != struct.unpack("<I", footer)[0]:
            return name, _records_before(name, start) + 1
    return None


def _records_before(name: str, offset: int) -> int:
    count = position = 0
    with open(name, "rb") as handle:
        while position < offset:
            handle.seek(position)
            length = struct.unpack("<Q", handle.read(8))[0]
            position += HEADER_BYTES + length + FOOTER_BYTES
            count += 1
    return count

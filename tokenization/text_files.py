"""Training text files: where a file stops being UTF-8, named so a user can fix it (the datasets library and the
tokenizers trainer only say that some read buffer failed to decode)."""


def first_invalid_utf8(path, chunk_bytes: int = 1 << 24) -> tuple[int, int, bool] | None:
    """(line, byte offset, whether the file ends there) of the first byte of `path` that is not valid UTF-8, or
    None when the whole file is; read in chunks, so any size fits in memory."""
    import codecs

    offset = line = 0  # bytes decoded and newlines among them, before `data`
    pending = b""  # a multi-byte character cut by the chunk boundary
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as err:
                at_end = err.reason == "unexpected end of data" and not handle.read(1)
                return line + data.count(b"\n", 0, err.start) + 1, offset + err.start, at_end
            if not chunk:
                return None
            line, offset, pending = line + data.count(b"\n", 0, used), offset + used, data[used:]


def utf8_problem(path) -> str | None:
    """One line naming where `path` stops being UTF-8 and how to fix it, or None when it is valid UTF-8."""
    found = first_invalid_utf8(path)
    if found is None:
        return None
    line, offset, at_end = found
    where = f"{path}: line {line}, byte offset {offset}"
    if at_end:
        return (f"{where}: the file ends inside a multi-byte UTF-8 character (its last line was cut); drop that "
                f"line (head -n -1 {path} > fixed.txt) or restore the file's end.")
    with open(path, "rb") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
    return (f"{where}: byte 0x{byte:02x} is not valid UTF-8; re-encode the file as UTF-8 (iconv -f <its encoding> "
            f"-t utf-8 {path} > fixed.txt) or remove the bad bytes.")

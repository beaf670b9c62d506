"""Token files (``data.path``): a .npy of token ids or a raw .bin, their layout read without
numpy. The spec loader checks a file with it; the trainer maps it into memory."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

# Element sizes of token files: a .npy's descr (its header says), a raw .bin's data.token_dtype.
NPY_ITEMSIZES = {"<u2": 2, "<i4": 4, "<i8": 8, "|u1": 1, "<u4": 4}
RAW_ITEMSIZES = {"uint16": 2, "int32": 4, "int64": 8}


def npy_layout(path: Path) -> tuple[int, str]:
    """The data offset and dtype (``descr``, a key of ``NPY_ITEMSIZES``) of a .npy token file,
    read from its header; ValueError naming the problem for a file that is not a readable .npy
    of token ids (bad magic or header, Fortran order, a dtype token ids do not come in)."""
    with open(path, "rb") as fh:
        if fh.read(6) != b"\x93NUMPY":
            raise ValueError(f"{path} is not a .npy file (bad magic); use .npy or a raw .bin")
        try:
            major = fh.read(2)[0]
            (length,) = struct.unpack("<H" if major == 1 else "<I", fh.read(2 if major == 1 else 4))
            header = ast.literal_eval(fh.read(length).decode("latin1"))
            if not isinstance(header, dict):
                raise ValueError("not a dict")
        except (IndexError, struct.error, ValueError, SyntaxError, MemoryError) as err:
            raise ValueError(
                f"{path} has a .npy header that cannot be read ({type(err).__name__}: {err}); "
                f"write the token ids with numpy.save"
            ) from None
        offset = fh.tell()
    if header.get("fortran_order") and len(header.get("shape", ())) > 1:
        raise ValueError(f"{path} is Fortran-ordered; save the token ids as a C-ordered array")
    descr = header.get("descr")
    if descr not in NPY_ITEMSIZES:
        raise ValueError(
            f"{path} holds dtype {descr!r}; .npy token files must be uint8, uint16, uint32, "
            "int32 or int64"
        )
    return offset, descr


def check_token_file(path: Path, token_dtype: str, sample_tokens: int) -> None:
    """ValueError where a token file cannot give one sample of ``sample_tokens`` tokens: not a
    readable .npy (``npy_layout``), or too short."""
    offset, descr = npy_layout(path) if path.suffix == ".npy" else (0, None)
    itemsize = NPY_ITEMSIZES[descr] if descr is not None else RAW_ITEMSIZES[token_dtype]
    count = max(0, path.stat().st_size - offset) // itemsize
    if count < sample_tokens:
        raise ValueError(
            f"{path} holds {count} tokens, fewer than the {sample_tokens} of one sample "
            f"(data.seq_len {sample_tokens - 1}); use more data or a shorter seq_len"
        )

"""Read an input file that anyone may have named, with bounded waiting and bounded memory.

[Note: reading input files]
Every file fsdp-plan reads as data (plans, hardware files, bench results, traces, Hugging Face
configs) goes through ``read_input_bytes``, which reads regular files only and at most a bound
per kind of document (issue 31):
- A FIFO with no writer blocks ``open()`` forever, and a device such as ``/dev/zero`` never
  ends (S4-08, S4-19). So the path is ``stat``-ed first (which opens nothing) and only a
  regular file is opened, with ``O_NONBLOCK`` so that a path swapped for a FIFO between the
  two calls still cannot block; the open descriptor is checked again with ``fstat``.
- The size is checked before reading, and the read stops at the bound plus one byte (a file
  that grows while it is read, or reports no size, is still bounded).
Every refusal is one ``BadInput`` paragraph naming the path (exit 2).
"""

from __future__ import annotations

import os
import stat

from fsdp_plan.common.errors import BadInput


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_regular(where: str, mode: int, hint: str) -> BadInput:
    """The refusal of a path that is a folder, pipe, device or socket."""
    return BadInput(f"{where} is {_kind_of(mode)}, not a regular file; fsdp-plan reads only "
                    f"regular files (a pipe or device could block or never end). {hint}")


def check_regular_file(path: str, where: str, hint: str) -> os.stat_result:
    """``stat`` ``path`` without opening it: refuse a missing path, a folder, a pipe, a device
    or a socket; returns the stat of the regular file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: a path must be a str or os.PathLike, got "
                        f"{type(path).__name__}.")
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise BadInput(f"{where} does not exist. {hint}") from e
    except (OSError, ValueError) as e:  # ENOTDIR, EACCES, ELOOP, a NUL in the name
        raise BadInput(f"{where} cannot be read ({getattr(e, 'strerror', None) or e}). "
                       f"{hint}") from e
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(where, st.st_mode, hint)
    return st


def read_input_bytes(path: str, where: str, max_bytes: int, *, hint: str, too_large: str,
                     limit_text: str | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` ([Note: reading input
    files]). ``where`` names the file in messages (``"plan file 'p.yaml'"``), ``hint`` says
    what to pass instead, ``too_large`` why a larger file is not one (``"a plan is about
    25 kB"``), ``limit_text`` the bound in words (default: its bytes)."""
    st = check_regular_file(path, where, hint)
    refusal = (f"{where} is larger than {limit_text or f'{max_bytes:,} bytes'}; {too_large}, "
               f"so it was not read. {hint}")
    if st.st_size > max_bytes:
        raise BadInput(refusal)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BadInput(f"{where} cannot be read ({e.strerror or e}). {hint}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between stat and open
            raise not_regular(where, mode, hint)
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise BadInput(f"{where} cannot be read ({e.strerror or e}). {hint}") from e
    finally:
        os.close(fd)
    if total > max_bytes:
        raise BadInput(refusal)
    return b"".join(chunks)

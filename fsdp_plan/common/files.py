"""Output files: checked before any work, written whole or not at all (SPEC 2).

[Note: output files]
- No output may be an input (the model file, the Hugging Face config, the hardware file) or
  another output: ``-o model.py`` would replace the user's code with the policy. Paths are
  compared after resolving symbolic links, and existing files by inode (hard links too).
- Each output is written to a temporary file in its own folder, synced, then renamed over the
  target, so a crash or a full disk never leaves a half-written file. Temporary names are short
  (``.fsdp-plan-XXXXXXXX.tmp``) so a legal long file name stays legal.
- Modes: a new file gets ``0666 & ~umask`` like any file the user's shell creates; a replaced
  file keeps its mode. (``mkstemp`` alone would make every output 0600.) The umask is the one
  the command started with (``remember_umask``, called by cli/main.py before any model is
  imported): a model that calls ``os.umask(0o777)`` at import made every output mode 000
  (issue 31, S4-14); model/load.py also restores the umask after each call into user code.
- A symbolic link given as an output is followed: the file it points to is replaced and the
  link stays.
- Failures name the user's path and the reason (disk full, permission denied, read-only file
  system), never a temporary file.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable

from fsdp_plan.common.errors import BadInput

TEMP_PREFIX = ".fsdp-plan-"
TEMP_SUFFIX = ".tmp"

_REASONS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free space on that disk or choose another path"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or choose another path"),
    errno.EACCES: ("permission denied", "choose a path you can write"),
    errno.EPERM: ("operation not permitted", "choose a path you can write"),
    errno.EROFS: ("the file system is read-only", "choose a path on a writable file system"),
    errno.ENAMETOOLONG: ("the file name is too long", "choose a shorter name"),
    errno.ENOENT: ("the folder does not exist", "create it or choose another path"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose a path inside a folder"),
    errno.EISDIR: ("it is a folder", "give a file path"),
    errno.EIO: ("an input/output error occurred", "check the disk or choose another path"),
    errno.EFBIG: ("the file is too large for that file system", "choose another path"),
}


def describe_os_error(error: OSError) -> tuple[str, str]:
    """``(reason, fix)`` in words for an ``OSError`` from creating or writing a file."""
    if error.errno in _REASONS:
        return _REASONS[error.errno]
    return (error.strerror or str(error)), "choose another path"


def write_failed(path: str, error: OSError, what: str = "", written: str = "nothing was written"
                 ) -> BadInput:
    """The one-paragraph ``BadInput`` for a failed write of ``path`` (names the user's path)."""
    reason, fix = describe_os_error(error)
    label = f"{what} {path!r}" if what else repr(path)
    return BadInput(f"{label} cannot be written ({reason}); {written}. To fix, {fix}.")


_started_umask: int | None = None
"""The umask the command started with (``remember_umask``); None: the process's current one."""


def current_umask() -> int:
    """The process's umask now (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remember_umask() -> int:
    """Record the umask new outputs follow, before any user code can change it; returns it."""
    global _started_umask
    _started_umask = current_umask()
    return _started_umask


def forget_umask() -> None:
    """The command is done: later writes follow the process's umask again."""
    global _started_umask
    _started_umask = None


def _creation_umask() -> int:
    return _started_umask if _started_umask is not None else current_umask()


def _temporary_name(folder: str) -> str:
    return os.path.join(folder, f"{TEMP_PREFIX}{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _create_temporary(folder: str, mode: int = 0o666) -> tuple[int, str]:
    """A new empty file in ``folder`` (``O_EXCL``: never an existing one); returns (fd, path).

    ``mode`` goes through the umask as for any new file."""
    for _ in range(100):
        tmp = _temporary_name(folder)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                           mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", folder)


def _target(path: str) -> str:
    """The file actually replaced: symbolic links are followed (the link itself stays)."""
    return os.path.realpath(path)


def _write_temporary(path: str, text: str | bytes) -> str:
    """``text`` (or bytes: a pickle) in a synced temporary file beside ``path``; returns the
    temporary's path.

    The temporary takes the mode ``path`` has now (if it exists) or ``0666 & ~umask``."""
    target = _target(path)
    folder = os.path.dirname(target)
    fd, tmp = _create_temporary(folder)
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes)
              else os.fdopen(fd, "w", encoding="utf-8")) as f:
            _keep_mode_and_owner(f.fileno(), target)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _keep_mode_and_owner(fd: int, target: str) -> None:
    """Give the temporary the mode (and, where allowed, the owner and group) of the file it
    replaces, so overwriting a 0755 script or a group-shared plan changes only its contents."""
    try:
        st = os.stat(target)
    except FileNotFoundError:  # a new file: 0666 less the umask the command started with
        os.fchmod(fd, 0o666 & ~_creation_umask())
        return
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    try:
        os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:  # only root may give a file away; the mode is what matters
        pass


def atomic_write_all(files: list[tuple[str, str | bytes]]) -> None:
    """Write every (path, text) through temporaries, renaming only once all are written.

    A failure while writing (disk full, permissions) renames nothing, removes the temporaries,
    leaves existing files as they were, and is reported as ``BadInput`` naming the path."""
    staged: list[tuple[str, str]] = []
    path = ""
    try:
        for path, text in files:
            staged.append((_write_temporary(path, text), path))
        for tmp, path in staged:
            os.replace(tmp, _target(path))
    except OSError as e:
        raise write_failed(path, e) from e
    except UnicodeEncodeError as e:
        raise BadInput(f"{path!r} cannot be written: its text holds {e.object[e.start:e.end]!r}, "
                       "which is not valid Unicode (an argument with undecodable bytes?); "
                       "nothing was written. Pass plain UTF-8 text.") from e
    finally:
        for tmp, _ in staged:
            if os.path.lexists(tmp):
                os.unlink(tmp)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    atomic_write_all([(path, text)])


def check_writable(path: str, what: str) -> None:
    """Fail early, before any work, when ``path`` cannot be written (the refusal says
    "nothing was written": every verb checks its outputs this way, issue 21 S3-34).

    Creates and removes a temporary file in the target folder: permission bits do not tell
    everything (``/proc``, read-only mounts, root on NFS), a real create does."""
    if not path:
        raise BadInput(f"{what} needs a file path, got an empty string.")
    if path.endswith((os.sep, "/")) or os.path.basename(path) in (".", ".."):
        raise BadInput(f"{what} {path!r} names a folder; give a file path inside it "
                       f"(e.g. {os.path.join(path.rstrip('/' + os.sep) or '.', 'plan.yaml')!r}).")
    target = _target(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        probe = folder
        while probe and not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if os.path.exists(probe) and not os.path.isdir(probe):
            raise BadInput(f"{what} {path!r}: {probe!r} is a file, not a folder; choose a path "
                           "inside a folder.")
        raise BadInput(f"{what} {path!r}: the folder {folder!r} does not exist; create it or "
                       "choose another path.")
    if os.path.isdir(target):
        raise BadInput(f"{what} {path!r} is a folder; give a file path.")
    if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
        raise BadInput(f"{what} {path!r} exists and is not a regular file (a device, pipe or "
                       "socket); give the path of a file to write.")
    name_max = _name_max(folder)
    if name_max and len(os.fsencode(os.path.basename(target))) > name_max:
        raise BadInput(f"{what} {path!r}: the file name is longer than the {name_max} bytes this "
                       "file system allows; choose a shorter name.")
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise BadInput(f"{what} {path!r} cannot be written (the file is read-only: permission "
                       "denied); make it writable or choose another path.")
    try:
        fd, tmp = _create_temporary(folder)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):  # the folder exists
            raise BadInput(f"{what} {path!r} cannot be written (the folder {folder!r} does not "
                           f"accept new files: {e.strerror or e}); nothing was written. To fix, "
                           "choose a path in an ordinary folder.") from e
        raise write_failed(path, e, what) from e
    os.close(fd)
    os.unlink(tmp)


def _name_max(folder: str) -> int | None:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return None


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def check_outputs(inputs: Iterable[tuple[str, str | None]],
                  outputs: Iterable[tuple[str, str | None]]) -> None:
    """Refuse an output that is one of the inputs or another output (SPEC 2: nothing is lost).

    ``inputs`` and ``outputs`` are ``(flag, path)`` pairs; ``None`` paths are skipped. Paths
    that resolve to the same file (symbolic or hard links included) count as the same."""
    given_inputs = [(flag, p) for flag, p in inputs if p]
    seen: list[tuple[str, str]] = []
    for flag, path in outputs:
        if not path:
            continue
        for in_flag, in_path in given_inputs:
            if _same_file(path, in_path):
                raise BadInput(f"{flag} {path!r} is the {in_flag} {in_path!r}: writing it would "
                               f"replace an input of this run. Choose another path for {flag}.")
        for out_flag, out_path in seen:
            if _same_file(path, out_path):
                raise BadInput(f"{flag} {path!r} and {out_flag} {out_path!r} are the same file; "
                               "each output needs its own path.")
        seen.append((flag, path))

"""Where commands write: never over a user's data, never half an output, with the umask's permissions.

- A command checks its output before it starts working (`check_output_file`, `check_output_dir`):
  an existing file, or a folder with anything in it, is refused unless the user passed `--force`.
- `atomic_file` and `atomic_directory` write into a temporary next to the target and move it in
  only once complete, so a killed writer never leaves half an output behind. A temporary is named
  `.<target name>.<pid>.<random>.part`: the next write to the same target removes those whose
  process is gone from this machine, and names any other in a warning.
- A folder output (predictors, activation statistics) owns some names (`OwnedNames`). Replacing
  it with `--force` replaces and removes only files with those names; anything else stays. The new
  set appears all at once: the other files join the new folder, which then swaps places with the
  old one in one rename (never a mix of old and new files, whenever the writer is killed).
- A folder output that is a symbolic link is written where the link points (the link stays).
- Temporaries are created with modes 0o666 / 0o777 less the umask, as `open()` and `mkdir` would:
  `tempfile`'s 0600 / 0700 would stay with the output after the rename.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from powerinfer.errors import PowerInferError

TEMP_SUFFIX = ".part"
FORCE_HINT = "pass --force to replace it"


class OutputExistsError(PowerInferError):
    """An output that would replace something the user has and did not ask us to replace."""


@dataclass(frozen=True)
class OwnedNames:
    """The file names a folder output writes: `pattern` matches them, `description` lists them."""

    pattern: re.Pattern[str]
    description: str

    def owns(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None


def warn(message: str) -> None:
    print(f"powerinfer: warning: {message}", file=sys.stderr)


def check_output_file(path: str | os.PathLike[str], force: bool) -> Path:
    """Refuse (one line) an output file whose folder is missing, that names a folder or something
    other than a file, or that exists while `force` is not given."""
    path = Path(path)
    if not path.parent.is_dir():
        raise PowerInferError(f"{path}: the output folder {path.parent} does not exist")
    if path.is_dir():
        raise OutputExistsError(f"{path}: is a folder; give an output file name")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise OutputExistsError(f"{path}: exists and is not a regular file")
        if not force:
            raise OutputExistsError(f"{path}: exists; {FORCE_HINT}")
    return path


def check_output_dir(path: str | os.PathLike[str], owned: OwnedNames, force: bool) -> Path:
    """Refuse (one line) an output folder that is something else, or not empty while `force` is not
    given (with it, only our files in it will be replaced)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{path}: exists and is not a folder")
    if path.is_dir() and not force and any(path.iterdir()):
        raise OutputExistsError(f"{path}: the folder is not empty; pass --force to replace our files in it "
                                f"({owned.description}) and leave the rest")
    _check_writable(path)
    return path


def _check_writable(folder: Path) -> None:
    """Refuse now a folder that could not be made or written to later: the nearest part of it
    that exists must be a folder we may write in (commands check before minutes of compute)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PowerInferError(f"{folder}: cannot be created, {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PowerInferError(f"{folder}: cannot write in {existing}")


def _temporary(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_leftovers(target: Path) -> None:
    """Remove the temporaries of `target` left by writers that were killed; name the rest."""
    name = re.escape(target.name)
    ours = re.compile(rf"\.{name}\.(\d+)\.[0-9a-f]+{re.escape(TEMP_SUFFIX)}")
    older = re.compile(rf"\.{name}\.(old\.)?[a-z0-9_]{{8}}(\.part)?")  # tempfile's names, before this module
    try:
        entries = [entry for entry in target.parent.iterdir() if entry.name.startswith(f".{target.name}.")]
    except OSError:
        return  # an unreadable folder: the write itself will report it
    for entry in entries:
        if older.fullmatch(entry.name):
            warn(f"{entry} looks left by an interrupted write of an older powerinfer; remove it")
        match = ours.fullmatch(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _running(pid):
            warn(f"{entry} may be a write in progress (process {pid}); remove it if it is not")
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as error:
            warn(f"cannot remove {entry}, left by an interrupted write: {error.strerror}")


def _cannot_write(path: Path, error: OSError) -> PowerInferError:
    return PowerInferError(f"cannot write {path}: {error.strerror or error}")


@contextmanager
def atomic_file(path: str | os.PathLike[str], replace: bool = True) -> Iterator[Path]:
    """A temporary path next to `path` that becomes `path` only if the block completes; an existing
    `path` is replaced only when `replace`."""
    path = Path(path)
    if not path.parent.is_dir():
        raise PowerInferError(f"{path}: the output folder {path.parent} does not exist")
    clean_leftovers(path)
    tmp = _temporary(path)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        yield tmp
        if path.is_dir():
            raise OutputExistsError(f"{path}: is a folder; give an output file name")
        if not replace and (path.exists() or path.is_symlink()):
            raise OutputExistsError(f"{path}: exists; {FORCE_HINT}")
        os.replace(tmp, path)
    except OSError as error:
        raise _cannot_write(path, error) from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


@contextmanager
def atomic_directory(target: str | os.PathLike[str], owned: OwnedNames, replace: bool = True) -> Iterator[Path]:
    """A temporary folder next to `target` whose files (all named as `owned` says) end up in
    `target` only if the block completes. A missing or empty `target` is replaced by it; a
    non-empty one, only when `replace`, swaps places with it at once, keeping the files we do not
    own (see the module docstring)."""
    target = Path(target)
    if target.is_symlink():  # written where it points: renaming over the link itself would fail at the end
        target = target.resolve()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PowerInferError(f"cannot create {target.parent}: {error.strerror}") from None
    clean_leftovers(target)
    staging = _temporary(target)
    try:
        os.mkdir(staging, 0o777)
        yield staging
        if target.exists() and not target.is_dir():
            raise OutputExistsError(f"{target}: exists and is not a folder")
        try:
            os.rename(staging, target)  # succeeds when target is missing or an empty folder
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not replace:
                raise OutputExistsError(f"{target}: the folder is not empty; {FORCE_HINT}") from None
            _swap_in(staging, target, owned)
    except OSError as error:
        raise _cannot_write(target, error) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _swap_in(staging: Path, target: Path, owned: OwnedNames) -> None:
    """Make `staging` the whole new `target`: the files of `target` we do not own join it (hard
    links where the file system allows, else copies), then the two folders swap places."""
    for entry in target.iterdir():
        if owned.owns(entry.name) and entry.is_file():
            continue  # ours from an earlier run: the new set replaces them
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / entry.name, symlinks=True)
            continue
        try:
            os.link(entry, staging / entry.name, follow_symlinks=False)
        except OSError:
            shutil.copy2(entry, staging / entry.name, follow_symlinks=False)
    os.chmod(staging, target.stat().st_mode & 0o7777)
    if not _exchange(staging, target):
        # Without an atomic exchange: two renames; a kill between them leaves the new set in the
        # temporary and the old one in `old`, both named in the next write's warning, never mixed.
        old = _temporary(target)
        os.rename(target, old)
        os.rename(staging, target)
        staging = old
    shutil.rmtree(staging)  # the old set now


RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 with RENAME_EXCHANGE, which Python's os module
    lacks); False where the system or file system does not offer it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))

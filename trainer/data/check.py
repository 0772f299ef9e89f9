"""`trainer-doctor --data DIR`: every image file of a data folder decoded as training will decode it, ahead of the
run, in every core; the files that do not decode and the class folders without an image, listed.

Training skips such a file (a black image of its label in its place, one warning, --max-bad-files bounds them:
trainer.data.images); this finds them all at once, before hours of an epoch, for repair. DIR is an image folder
(train/<class>/*, val/<class>/*), one split of it (<class>/*), or a pack (trainer-pack: the files it packed as
placeholders, from pack.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.config import catalog
from trainer.config.settings import TrainConfig
from trainer.core.errors import UsageError

SPLITS = ("train", "val")


@dataclass
class Report:
    where: list[str]                  # the folders checked
    files: int = 0
    bad: list[dict[str, str]] = field(default_factory=list)    # {"path", "reason"}
    empty_class_folders: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad and not self.empty_class_folders


def _splits(root: Path) -> list[Path]:
    if not root.is_dir():
        raise UsageError("--data", f"'{root}' is not a folder", "give an image folder (train/<class>/*), one of its "
                         "splits, or a pack")
    splits = [root / split for split in SPLITS if (root / split).is_dir()]
    return splits or [root]


def _files(split: Path, classes: list[str]) -> list[str]:
    """ImageFolder's files of a split: every file with an image extension under each class folder, any depth."""
    found = []
    for name in classes:
        for folder, _, names in sorted(os.walk(split / name, followlinks=True)):
            found += [os.path.join(folder, n) for n in sorted(names) if n.lower().endswith(catalog.IMAGE_EXTENSIONS)]
    return found


def _decode(job: tuple[str, str, int]) -> str | None:
    """Why the file does not decode on the path training takes (--decode), or None."""
    path, decode, side = job
    from trainer.data.images import UnreadableImage

    try:
        if decode == "pil":
            from torchvision.datasets.folder import pil_loader

            pil_loader(path)
        else:  # the CPU path; the GPU path's workers and its CPU decode refuse what it refuses
            from trainer.data.jpeg import read_view

            read_view(path, 0, side, False, "none")
    except UnreadableImage as err:
        return err.reason
    except OSError as err:  # PIL's ways (the reference path)
        from PIL import UnidentifiedImageError

        return "not an image PIL can decode" if isinstance(err, UnidentifiedImageError) else str(err).splitlines()[0]
    return None


def check(root: Path, cfg: TrainConfig, workers: int) -> Report:
    started = time.perf_counter()
    if (root / "pack.json").is_file():  # a pack: its placeholders are the files that did not decode when packed
        from trainer.data.pack import open_pack

        header = open_pack(root).header
        report = Report([str(root)], sum(s["images"] for s in header["splits"].values()))
        report.bad = [{"path": path, "reason": why} for entries in header.get("bad_files", {}).values()
                      for path, why in entries.values()]
        return report
    report = Report([])
    jobs = []
    for split in _splits(root):
        try:
            classes, empty = catalog.class_folders(split)
        except OSError as err:
            raise UsageError("--data", f"cannot list {split} ({err.strerror})", "make it readable") from None
        report.where.append(str(split))
        report.empty_class_folders += [str(split / name) for name in empty]
        jobs += [(path, cfg.decode, cfg.image_size) for path in _files(split, classes)]
    report.files = len(jobs)
    if jobs:
        from multiprocessing import get_context

        from trainer.data import jpeg  # noqa: F401 (torch, PIL: imported once, before the workers fork)

        with get_context("fork").Pool(max(1, min(workers, len(jobs)))) as pool:
            reasons = pool.map(_decode, jobs, chunksize=max(1, min(64, len(jobs) // (4 * workers) or 1)))
        report.bad = [{"path": path, "reason": why} for (path, _, _), why in zip(jobs, reasons) if why is not None]
    report.seconds = time.perf_counter() - started
    return report


def main(root: str, cfg: TrainConfig, as_json: bool) -> int:
    """trainer-doctor --data: the report on stdout; exit 1 when a file does not decode or a class holds no image."""
    report = check(Path(root), cfg, os.cpu_count() or 1)
    if as_json:
        print(json.dumps({"ok": report.ok, **asdict(report)}, indent=2))
        return 0 if report.ok else 1
    where = ", ".join(report.where)
    print(f"checked {report.files} image files in {where} ({report.seconds:.1f} s, --decode {cfg.decode}): "
          f"{len(report.bad)} do not decode, {len(report.empty_class_folders)} class folders hold no image")
    for bad in report.bad:
        print(f"  does not decode: {bad['path']} ({bad['reason']})")
    for folder in report.empty_class_folders:
        print(f"  no image in the class folder {folder}")
    if not report.ok:
        print("training skips a file that does not decode (a black image of its label in its place; --max-bad-files "
              "bounds how many an epoch may skip) and refuses a class folder without an image: repair or remove "
              "them", file=sys.stderr)
    return 0 if report.ok else 1

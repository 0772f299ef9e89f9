"""`trainer-pack SRC DST --max-side 256`: an image folder as a few large files, and `--dataset packed`.

DST holds, per split (train, val): `<split>.pixels`, every image's RGB pixels (uint8, height x width x 3,
the longer side at most --max-side) one after another, and `<split>.index`, one little-endian int64
record (offset, height, width, label) per image in ImageFolder's order; `pack.json` names the format
version, the classes and each file's size. Training memory-maps both: a sample is a slice of the
pixels, its view (jpeg.view_plan: the same crops, flips and keys as an image folder) one resize.

A source file that does not decode (truncated, not an image) is packed as a black 1 x 1 placeholder with its label,
one warning each, and named in pack.json (`bad_files`: per split, index -> [path, why]); training treats it as
an image folder treats the file itself (a black view, counted against --max-bad-files). More than --max-bad-files
of a split stop the pack (one line; fix the files, and the same command continues).

Written so that an interrupted pack loses nothing: the files grow as `<name>.partial` beside a
`pack-progress.json` (the source, the settings, the files done); a second run with the same SRC and
settings continues from the last whole image, and `pack.json` is renamed into place last, so a folder
with one is complete. The trainer checks the files against pack.json before the first step.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.config.settings import bad_file_bound
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error
from trainer.core.files import fsync_file, write_json_atomic

PACK_FORMAT, PACK_VERSION = "trainer-pack", 1
SPLITS = ("train", "val")
RECORD = 4  # int64s per index record: offset, height, width, label
PROGRESS = "pack-progress.json"
SYNC_EVERY = 512  # images between flushes of the partial files (what a crash can cost)


def _listing(src: Path):
    from torchvision import datasets

    found = {}
    for split in SPLITS:
        if (src / split).is_dir():
            try:
                found[split] = datasets.ImageFolder(str(src / split))
            except OSError as err:
                raise UsageError("SRC", f"{src / split}: {err}", f"put images in {src / split}/<class>/") from None
    if "train" not in found:
        raise UsageError("SRC", f"'{src}' has no train/ folder", "give a folder with train/<class>/*.jpg "
                         "(and val/<class>/*.jpg)")
    if "val" in found and found["val"].classes != found["train"].classes:
        raise UsageError("SRC", f"train/ and val/ under {src} have different class folders",
                         "give val/ the same class folders as train/")
    return found


def shrink(path: str, max_side: int) -> np.ndarray:
    """One image as uint8 H x W x 3, the longer side at most max_side (DCT-domain reduction first)."""
    from PIL import Image

    from trainer.data.jpeg import pil_rgb, unreadable

    try:
        image = Image.open(path)
        width, height = image.size
        ratio = max_side / max(width, height)
        if ratio < 1:
            target = (max(1, round(width * ratio)), max(1, round(height * ratio)))
            image.draft("RGB", target)  # at least target: libjpeg reduces by 2, 4 or 8 no further
            image = pil_rgb(image, path).resize(target, Image.BILINEAR, reducing_gap=None)
        else:
            image = pil_rgb(image, path)
        return np.asarray(image)
    except (OSError, SyntaxError, ValueError) as err:
        raise unreadable(path, err) from None


def _shrink_job(job: tuple[str, int]):
    from trainer.data.images import UnreadableImage

    try:
        return shrink(*job), None
    except UnreadableImage as err:  # named and counted in the parent
        return None, (err.path, err.reason)


def pack(src: Path, dst: Path, max_side: int, workers: int, progress: bool = True, max_bad: str = "0.001") -> dict:
    """Pack src into dst (see the module's docstring); returns pack.json's content."""
    from tqdm import tqdm

    if (dst / "pack.json").exists():
        raise UsageError("DST", f"{dst} already holds a finished pack",
                         "choose another folder, or remove it to re-pack")
    listing = _listing(src)
    dst.mkdir(parents=True, exist_ok=True)
    settings = {"src": str(src.resolve()), "max_side": max_side,
                "images": {split: len(folder.samples) for split, folder in listing.items()},
                "classes": listing["train"].classes}
    state_file = dst / PROGRESS
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    if state is None or state.get("settings") != settings:  # another source or other settings: start afresh
        for name in [*(f"{s}.{kind}.partial" for s in SPLITS for kind in ("pixels", "index")), PROGRESS]:
            (dst / name).unlink(missing_ok=True)
        state = {"settings": settings, "done": []}
        write_json_atomic(state_file, state, indent=1)
    state.setdefault("bad_files", {})
    total = sum(settings["images"].values())
    done_before = sum(settings["images"][s] for s in state["done"])
    splits = {}
    with tqdm(total=total, initial=done_before, unit="img", desc=f"packing {src.name}", disable=not progress,
              file=sys.stderr) as bar:
        for split, folder in listing.items():
            if split not in state["done"]:
                bound = bad_file_bound(max_bad, len(folder.samples))
                _pack_split(folder.samples, dst, split, max_side, workers, bar, state, state_file, bound)
                state["done"].append(split)
                write_json_atomic(state_file, state, indent=1)
            splits[split] = {"images": len(folder.samples), "pixels_bytes": (dst / f"{split}.pixels").stat().st_size,
                             "index_bytes": (dst / f"{split}.index").stat().st_size}
    header = {"format": PACK_FORMAT, "version": PACK_VERSION, "max_side": max_side, "source": settings["src"],
              "classes": settings["classes"], "splits": splits,
              "bad_files": {split: bad for split, bad in state["bad_files"].items() if bad}}
    write_json_atomic(dst / "pack.json", header, indent=1)  # last: a folder with pack.json holds a whole pack
    state_file.unlink()
    return header


PLACEHOLDER = np.zeros((1, 1, 3), dtype=np.uint8)  # what a file that does not decode is packed as


def _pack_split(samples: list, dst: Path, split: str, max_side: int, workers: int, bar, state: dict,
                state_file: Path, bound: int) -> None:
    from multiprocessing import get_context

    pixels_path, index_path = dst / f"{split}.pixels.partial", dst / f"{split}.index.partial"
    pixels_path.touch()
    index_path.touch()
    # Continue after the last whole image: the whole records whose pixels are all there (a crash can
    # leave half a record, or records whose pixels never reached the disk); anything beyond is cut off.
    index = np.fromfile(index_path, dtype="<i8", count=index_path.stat().st_size // (8 * RECORD) * RECORD)
    ends = np.cumsum(index.reshape(-1, RECORD)[:, 1] * index.reshape(-1, RECORD)[:, 2] * 3)
    records = int(np.searchsorted(ends, pixels_path.stat().st_size, side="right"))
    end = int(ends[records - 1]) if records else 0
    os.truncate(index_path, records * 8 * RECORD)
    os.truncate(pixels_path, end)
    bad = {index: entry for index, entry in state["bad_files"].get(split, {}).items() if int(index) < records}
    state["bad_files"][split] = bad
    bar.update(records)
    bar.refresh()  # where the pack continues, shown before the first new image
    todo = [(path, max_side) for path, _ in samples[records:]]
    with open(pixels_path, "ab") as pixels, open(index_path, "ab") as index, \
            get_context("spawn" if sys.platform == "darwin" else "fork").Pool(workers) as pool:
        for number, ((image, problem), (_, label)) in enumerate(zip(pool.imap(_shrink_job, todo, chunksize=8),
                                                                    samples[records:]), start=records):
            if image is None:
                path, why = problem
                bad[str(number)] = [path, why]
                bar.write(f"warning: {path} does not decode ({why}): packed as a black placeholder", file=sys.stderr)
                if len(bad) > bound:
                    pixels.flush(), index.flush()
                    raise UsageError("--max-bad-files", f"{len(bad)} file(s) of {split}/ do not decode, more than the "
                                     f"{bound} it allows; the last: {path} ({why})", "repair or remove it, then run "
                                     "the same command again: it continues (or raise --max-bad-files)")
                # Before its record: a pack continued after a crash keeps the entries of the records it keeps.
                write_json_atomic(state_file, state, indent=1)
                image = PLACEHOLDER
            height, width = image.shape[:2]
            pixels.write(image.tobytes())
            index.write(np.array([end, height, width, label], dtype="<i8").tobytes())
            end += height * width * 3
            bar.update(1)
            if number % SYNC_EVERY == 0:
                pixels.flush(), index.flush()
        for f in (pixels, index):
            fsync_file(f)
    pixels_path.rename(dst / f"{split}.pixels")
    index_path.rename(dst / f"{split}.index")




# --------------------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class Pack:
    root: Path
    header: dict

    @property
    def classes(self) -> list[str]:
        return self.header["classes"]


def repack(root: Path, what: str) -> UsageError:
    source = " ".join(["trainer-pack", "SRC", str(root)])
    return UsageError("--data-dir", what, f"re-pack: remove {root} and run {source}")


def open_pack(root: Path) -> Pack:
    """pack.json and the files it names, checked: sizes, versions and the index against the pixels."""
    header_path = root / "pack.json"
    try:
        header = json.loads(header_path.read_text())
    except (OSError, ValueError) as err:
        raise repack(root, f"{header_path} cannot be read ({err})") from None
    if not isinstance(header, dict) or header.get("format") != PACK_FORMAT:
        raise repack(root, f"{header_path} is not a trainer-pack header")
    if header.get("version") != PACK_VERSION:
        raise repack(root, f"{header_path} is version {header.get('version')} of the format and this trainer "
                           f"reads version {PACK_VERSION}")
    for split, facts in header["splits"].items():
        for kind in ("pixels", "index"):
            path = root / f"{split}.{kind}"
            size = path.stat().st_size if path.is_file() else None
            if size != facts[f"{kind}_bytes"]:
                state = "is missing" if size is None else \
                    f"is truncated ({size} of {facts[f'{kind}_bytes']} bytes)" if size < facts[f"{kind}_bytes"] \
                    else f"has {size} bytes, and pack.json says {facts[f'{kind}_bytes']}"
                raise repack(root, f"{path} {state}")
        index = _index(root, split, facts["images"])
        if index is None:
            raise repack(root, f"{root / f'{split}.index'} holds {facts['index_bytes']} bytes, not "
                               f"{facts['images']} records")
        ends = index[:, 0] + index[:, 1] * index[:, 2] * 3
        contiguous = len(index) == 0 or (index[0, 0] == 0 and np.array_equal(index[1:, 0], ends[:-1]))
        if not contiguous or (len(index) and int(ends[-1]) != facts["pixels_bytes"]) or \
                (index[:, 1:3] < 1).any() or (index[:, 3] < 0).any() or (index[:, 3] >= len(header["classes"])).any():
            raise repack(root, f"{root / f'{split}.index'} does not match {root / f'{split}.pixels'}")
    return Pack(root, header)


def _index(root: Path, split: str, images: int):
    path = root / f"{split}.index"
    if path.stat().st_size != images * 8 * RECORD:
        return None
    if images == 0:
        return np.zeros((0, RECORD), dtype="<i8")
    return np.memmap(path, dtype="<i8", mode="r", shape=(images, RECORD))


class PackedImages:
    """One split of a pack as a map-style dataset keyed (index, epoch), like the image folders."""

    augments_samples = True  # --auto-augment and --random-erase in the loader's workers, as the image folders'

    def __init__(self, pack: Pack, split: str, train: bool, image_size: int, augment: str, seed: int, *,
                 resize: int = 0, interpolation: str = "bilinear", samples=None):
        self.root, self.split, self.images = pack.root, split, pack.header["splits"][split]["images"]
        # Placeholders of files that did not decode when packed: named and counted as an image folder's would be.
        placeholders = pack.header.get("bad_files", {}).get(split, {})
        self.bad = {int(i): f"{path}\0{why}" for i, (path, why) in placeholders.items()}
        self.train, self.side, self.augment, self.seed = train, image_size, augment, seed
        self.resize, self.interpolation, self.samples = resize, interpolation, samples if train else None
        self._maps = None  # opened in the process that reads (a DataLoader worker), not pickled to it

    def __len__(self) -> int:
        return self.images

    def __getstate__(self):
        return {**self.__dict__, "_maps": None}

    def __getitem__(self, key: tuple[int, int]):
        import torch

        from trainer.data.images import sample_key
        from trainer.data.jpeg import resize_view, view_plan

        if self._maps is None:
            self._maps = (np.memmap(self.root / f"{self.split}.pixels", dtype=np.uint8, mode="r"),
                          _index(self.root, self.split, self.images))
        pixels, index = self._maps
        sample, epoch = key
        offset, height, width, label = (int(v) for v in index[sample])
        with warnings.catch_warnings():  # a read-only map: nothing writes into the view (resize makes new tensors)
            warnings.simplefilter("ignore", UserWarning)
            image = torch.from_numpy(pixels[offset:offset + height * width * 3].reshape(height, width, 3))
        # Views are planned on the packed geometry: the same statistics (relative boxes) as the source's.
        key = sample_key(sample, epoch, self.seed)
        plan = view_plan(key, width, height, self.side, self.train, self.augment, self.resize)
        view = resize_view(image.permute(2, 0, 1), plan, self.side, interpolation=self.interpolation)
        return (view if self.samples is None else self.samples(view, key)), label, self.bad.get(sample, "")


def packed_datasets(cfg):
    from trainer.config.catalog import DATASETS
    from trainer.config.settings import crop_sizes
    from trainer.data.augment import sample_augment
    from trainer.data.images import builtin_spec

    pack_ = open_pack(Path(cfg.data_dir))
    splits = pack_.header["splits"]
    train_crop, _, val_crop = crop_sizes(cfg)
    samples = sample_augment(cfg, DATASETS["packed"].mean, DATASETS["packed"].channels)
    train = PackedImages(pack_, "train", True, train_crop, cfg.augment, cfg.seed, interpolation=cfg.interpolation,
                         samples=samples)
    val = PackedImages(pack_, "val", False, val_crop, cfg.augment, cfg.seed, resize=cfg.val_resize_size,
                       interpolation=cfg.interpolation) if "val" in splits else None
    return train, val, builtin_spec("packed", train_crop, len(pack_.classes))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="trainer-pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", metavar="SRC", type=Path, help="image folder: train/<class>/* (and val/<class>/*)")
    parser.add_argument("dst", metavar="DST", type=Path, help="folder for the pack (--dataset packed --data-dir DST)")
    parser.add_argument("--max-side", type=int, default=256, help="longer side of the packed images in pixels "
                        "(larger ones are shrunk; default 256)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes "
                        "(default: every core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--max-bad-files", default="0.001", help="files of a split that may not decode (packed as "
                        "black placeholders, each with a warning): a count (10) or a fraction of the split (0.001: "
                        "0.1%%, at least 1; default); more stop the pack")
    with exit_on_usage_error():
        args = parser.parse_args(argv)
        if args.max_side < 8:
            raise UsageError("--max-side", f"{args.max_side} is below 8", "use 8 or more (256 for ImageNet)")
        if args.workers < 1:
            raise UsageError("--workers", f"{args.workers} is below 1", "use 1 or more")
        if not args.src.is_dir():
            raise UsageError("SRC", f"'{args.src}' is not a folder", "give the image folder's root")
        bad_file_bound(args.max_bad_files, 0)
        header = pack(args.src, args.dst, args.max_side, args.workers, progress=not args.no_progress,
                      max_bad=args.max_bad_files)
    size = sum(f["pixels_bytes"] + f["index_bytes"] for f in header["splits"].values())
    counts = ", ".join(f"{split}: {facts['images']} images" for split, facts in header["splits"].items())
    bad = sum(len(entries) for entries in header["bad_files"].values())
    placeholders = f"; {bad} file(s) did not decode: black placeholders, named in pack.json" if bad else ""
    print(f"packed {counts} ({size / 2**30:.2f} GiB) into {args.dst}{placeholders}; train with --dataset packed "
          f"--data-dir {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

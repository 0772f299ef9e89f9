"""Image files at speed: the geometry of every view, the fast CPU path and the GPU (nvJPEG) path.

What a sample shows is decided before any pixel is decoded, from the image's size (in its header) and
its key (data.sample_key: seed, epoch, index): a box of the source image, resized to the side, maybe
flipped. The CPU path, the GPU path and the packed format (trainer/data/pack.py) all draw that view from
`view_plan`, so one sample looks the same (up to resampling) whichever path reads it, and a resumed
run sees what the uninterrupted one would have.

The CPU path decodes no more than the view needs: a box at least twice the side in both directions
lets libjpeg scale in the DCT domain (Pillow's draft, 1/2 to 1/8) and the box is mapped onto the
reduced image; other JPEGs are decoded by torchvision straight into a tensor (no PIL image, no copy);
the box is resized by torch's uint8 antialiased bilinear kernel (PIL's filter, several times faster).
The random-resized-crop statistics are torchvision's (scale 0.08-1, ratio 3/4-4/3, ten attempts, then
the centre), drawn from a Python RNG seeded by the key: torch's generator costs more per sample
(fork, seed, restore) than the resize does.

The GPU path: DataLoader workers read file bytes and plan views (header only); a decoding thread of the
training process decodes each batch with nvJPEG on a side stream, and crops, resizes and flips the whole
batch in a few kernels (roi_align), up to DECODE_AHEAD batches ahead of the step. torchvision's batched
decode holds its calling thread until the batch is decoded (it synchronises its own stream); in the
training thread that wait came between the steps (0.75 of synthetic data, eager ResNet-50 on an H200,
2026-11-27), in the decoding thread the training thread goes on launching kernels meanwhile. No host
sync: the training stream waits for the batch's CUDA event. --decode-gpu-share below 1 leaves a share of
each batch's samples (chosen by their keys, so a resumed run decodes the same ones the same way) to the
loader's workers on the CPU path, as DALI's hw_decoder_load does: the two decoders then add up. Files
nvJPEG cannot take (PNG, CMYK, progressive or damaged JPEGs) are viewed by the CPU path in the worker
instead, with one warning per run.

A file no path decodes gives a black view of its label instead (trainer.data.images: BadFiles names and counts it).
"""

from __future__ import annotations

import io
import logging
import math
import queue
import random
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.config.settings import augment_policy
from trainer.core.errors import first_line
from trainer.data.images import UNDECODED_HERE, ImageFolderWithKeys, UnreadableImage, replacement, sample_key

log = logging.getLogger(__name__)

RRC_SCALE = (0.08, 1.0)  # torchvision.transforms.RandomResizedCrop's defaults: the statistics users know
RRC_RATIO = (3 / 4, 4 / 3)
VAL_RESIZE = 8 / 7  # validation: the shorter side resized to 8/7 of the crop, then the centre crop (256 -> 224)
DRAFT_SCALES = (8, 4, 2)  # the DCT-domain reductions Pillow's draft offers
JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"


@dataclass(frozen=True)
class ViewPlan:
    """One sample's view: the box (left, top, width, height) of the source image, resized to side x side,
    then flipped; `shift` is the light policy's random crop of the padded view (dy, dx), or None."""
    left: int
    top: int
    width: int
    height: int
    flip: bool
    shift: tuple[int, int] | None = None


def light_padding(side: int) -> int:
    return max(1, side // 8)  # the CIFAR recipe: padding of 1/8 of the side (4 at 32 px)


def random_resized_box(rnd: random.Random, width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, drawn from `rnd`: (left, top, w, h)."""
    area = width * height
    log_ratio = (math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1]))
    for _ in range(10):
        target = area * rnd.uniform(*RRC_SCALE)
        aspect = math.exp(rnd.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rnd.randint(0, width - w), rnd.randint(0, height - h), w, h
    in_ratio = width / height  # the fallback: a central crop of the whole image, ratio clamped
    if in_ratio < RRC_RATIO[0]:
        w, h = width, int(round(width / RRC_RATIO[0]))
    elif in_ratio > RRC_RATIO[1]:
        h, w = height, int(round(height * RRC_RATIO[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_box(width: int, height: int, resize: int, side: int) -> tuple[int, int, int, int]:
    """transforms.Resize(resize) then CenterCrop(side), as a box of the source image."""
    short, long = (width, height) if width <= height else (height, width)
    long_resized = int(resize * long / short)
    rw, rh = (resize, long_resized) if width <= height else (long_resized, resize)
    left, top = int(round((rw - side) / 2.0)), int(round((rh - side) / 2.0))
    sx, sy = width / rw, height / rh
    x0, y0 = round(left * sx), round(top * sy)
    x1, y1 = round((left + side) * sx), round((top + side) * sy)
    x0, y0 = min(max(0, x0), width - 1), min(max(0, y0), height - 1)
    return x0, y0, max(1, min(width, x1) - x0), max(1, min(height, y1) - y0)


def view_plan(key: int, width: int, height: int, side: int, train: bool, augment: str, resize: int = 0) -> ViewPlan:
    """The view of one sample of a width x height image: a pure function of the key and the geometry. resize: the
    validation images' shorter side before the centre crop (--val-resize-size; 0: 8/7 of the side for the imagenet
    policy, the side for the others)."""
    augment = augment_policy(augment, side)
    if augment == "imagenet" and train:
        rnd = random.Random(key)
        left, top, w, h = random_resized_box(rnd, width, height)
        return ViewPlan(left, top, w, h, rnd.random() < 0.5)
    if train or not resize:
        resize = int(side * VAL_RESIZE) if augment == "imagenet" else side
    box = center_box(width, height, resize, side)
    if train and augment == "light":
        rnd = random.Random(key)
        span = 2 * light_padding(side) + 1
        return ViewPlan(*box, rnd.random() < 0.5, (rnd.randrange(span), rnd.randrange(span)))
    return ViewPlan(*box, False)


# ----------------------------------------------------------------------------------- the CPU path

def resize_view(image: torch.Tensor, plan: ViewPlan, side: int, scale: float = 1.0,
                interpolation: str = "bilinear") -> torch.Tensor:
    """uint8 C x H x W (any strides) -> the plan's uint8 C x side x side view; `scale`: how much smaller
    `image` is than the source image the plan was made for (a DCT-reduced decode, a packed copy);
    interpolation: nearest, bilinear or bicubic (--interpolation; antialiased but nearest, as PIL's are)."""
    _, height, width = image.shape
    x0 = min(int(plan.left * scale), width - 1)
    y0 = min(int(plan.top * scale), height - 1)
    x1 = min(max(x0 + 1, round((plan.left + plan.width) * scale)), width)
    y1 = min(max(y0 + 1, round((plan.top + plan.height) * scale)), height)
    # torch's uint8 antialiased kernel wants channels-last; a permuted HWC array already is.
    box = image[None, :, y0:y1, x0:x1].contiguous(memory_format=torch.channels_last)
    if interpolation == "nearest":
        out = torch.nn.functional.interpolate(box, size=(side, side), mode="nearest-exact")[0]
    else:
        out = torch.nn.functional.interpolate(box, size=(side, side), mode=interpolation, antialias=True,
                                              align_corners=False)[0]
    if plan.shift is not None:
        pad = light_padding(side)
        dy, dx = plan.shift
        out = torch.nn.functional.pad(out, (pad, pad, pad, pad))[:, dy:dy + side, dx:dx + side]
    # Left channels-last: the batch's collation copies it anyway (a .contiguous() here cost 0.1 ms a sample).
    return out.flip(-1) if plan.flip else out


def pil_rgb(image, path: str):
    """An RGB PIL image of any mode; 16-bit greyscale (PNG) scaled to 8 bits instead of clipped to white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        _warn_once(path, "a 16-bit image: scaled to 8 bits")
        pixels = np.asarray(image, dtype=np.uint32 if image.mode == "I" else np.uint16)
        high = 65535 if image.mode != "I" else max(1, int(pixels.max()))
        from PIL import Image

        return Image.fromarray((pixels.astype(np.float32) * (255 / high)).round().astype(np.uint8)).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def pil_tensor(image) -> torch.Tensor:
    """An RGB PIL image as uint8 3 x H x W (a channels-last view of one copy of its pixels)."""
    with warnings.catch_warnings():  # np.asarray(PIL image) is read-only; nothing writes into the view
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


_warned: set[str] = set()


def _warn_once(path: str, what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("%s: %s (further such files are not named)", path, what)


def unreadable(path: str, err: BaseException, data: bytes | None = None) -> UnreadableImage:
    from PIL import UnidentifiedImageError

    if data is not None and not data:
        reason = "an empty file"
    elif isinstance(err, UnidentifiedImageError):
        reason = "not an image PIL can decode"
    else:
        reason = first_line(err)
    return UnreadableImage.of(path, reason)


def read_view(path: str, key: int, side: int, train: bool, augment: str, resize: int = 0,
              interpolation: str = "bilinear") -> torch.Tensor:
    """One sample of the fast CPU path: the file's planned view, uint8 3 x side x side."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise unreadable(path, err) from None
    return view_from_bytes(data, path, key, side, train, augment, resize, interpolation)


def view_from_bytes(data: bytes, path: str, key: int, side: int, train: bool, augment: str, resize: int = 0,
                    interpolation: str = "bilinear") -> torch.Tensor:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))  # the header only: size, mode, format
        width, height = image.size
        plan = view_plan(key, width, height, side, train, augment, resize)
        reduce = next((r for r in DRAFT_SCALES if min(plan.width, plan.height) >= r * side), 1)
        if image.format == "JPEG" and reduce == 1 and image.mode in ("RGB", "L") and data.endswith(JPEG_EOI):
            from torchvision.io import ImageReadMode, decode_jpeg

            try:  # straight into a tensor: no PIL image and no copy out of it
                pixels = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
                return resize_view(pixels, plan, side, interpolation=interpolation)
            except RuntimeError:
                pass  # PIL below decodes it or says what is wrong
        if image.format == "JPEG" and reduce > 1:
            image.draft("RGB", (width // reduce, height // reduce))  # libjpeg scales in the DCT domain
        image = pil_rgb(image, path)
        return resize_view(pil_tensor(image), plan, side, image.size[0] / width, interpolation)
    except (OSError, SyntaxError, ValueError) as err:  # PIL's ways of saying a file is damaged
        raise unreadable(path, err, data) from None


class FastImageFolder(ImageFolderWithKeys):
    """--dataset imagefolder on the fast CPU path (--decode cpu)."""

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        path, label = self.folder.samples[index]
        try:
            view = read_view(path, sample_key(index, epoch, self.seed), self.side, self.train, self.augment,
                             self.resize, self.interpolation)
        except UnreadableImage as err:
            return replacement(self.side), label, err.entry
        return self.augmented(view, index, epoch), label, ""


# ----------------------------------------------------------------------------------- the GPU path

def jpeg_geometry(data: bytes) -> tuple[int, int, int, int] | None:
    """(width, height, components, SOF marker) from a JPEG's frame header; None when the bytes are not a
    whole JPEG (no SOI, no EOI at the end, no frame header)."""
    if not (data.startswith(JPEG_SOI) and data.endswith(JPEG_EOI)):
        return None
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if at + 10 > end:
                return None
            height = int.from_bytes(data[at + 5:at + 7], "big")
            width = int.from_bytes(data[at + 7:at + 9], "big")
            return width, height, data[at + 9], marker
        at += 2 + length
    return None


def nvjpeg_can_decode(geometry: tuple[int, int, int, int] | None) -> bool:
    # Baseline and extended Huffman JPEGs of 1 or 3 components: what nvJPEG's batched decode takes.
    return geometry is not None and geometry[3] in (0xC0, 0xC1) and geometry[2] in (1, 3) and min(geometry[:2]) > 0


@dataclass
class FileBatch:
    """What a worker hands the training process for one batch of the GPU path (GpuImageFolder.collate)."""
    # The JPEG files nvJPEG decodes, end to end in one tensor: one shared-memory segment per batch from
    # the worker, not one (and a file descriptor) per file.
    encoded_bytes: torch.Tensor   # uint8
    lengths: list[int]
    boxes: torch.Tensor           # float32 [len(encoded), 4]: x0, y0, x1, y1 in source pixels
    flips: torch.Tensor           # bool [len(encoded)]
    on_gpu: torch.Tensor          # long: positions in the batch of the encoded ones
    viewed: torch.Tensor          # uint8 [k, 3, side, side]: the views the CPU path made, of the others
    on_cpu: torch.Tensor          # long: their positions in the batch
    labels: torch.Tensor
    paths: list[str]              # of the encoded ones, to name a file nvJPEG refuses
    fallback: str                 # the first file of the batch that took the CPU path ("" if none)
    bad: list[str] = field(default_factory=list)  # per sample: a file no path decoded (images.BadFiles), or ""

    @property
    def encoded(self) -> list[torch.Tensor]:
        return list(torch.split(self.encoded_bytes, self.lengths)) if self.lengths else []

    def pin_memory(self) -> "FileBatch":
        self.encoded_bytes = self.encoded_bytes.pin_memory()
        self.viewed, self.labels = self.viewed.pin_memory(), self.labels.pin_memory()
        return self


SHARE_UNITS = 1 << 16  # --decode-gpu-share is applied in 1/65536ths of the key space


def decoded_on_gpu(sample: int, share: float) -> bool:
    """Whether this sample (its key) goes to the device's decoder: a pure function of the key, so every run and
    every resume sends the same samples the same way. The key's high bits: the low ones pick its crop."""
    return share >= 1.0 or ((sample * 0x2545F491) >> 15) % SHARE_UNITS < share * SHARE_UNITS


class GpuImageFolder(ImageFolderWithKeys):
    """--dataset imagefolder on the GPU path (--decode gpu): workers read bytes, the device decodes."""

    gpu_share = 1.0  # --decode-gpu-share: the rest of each batch is viewed on the CPU path, in the workers
    # --auto-augment and --random-erase: on the device, after the decode (data.Batches), the CPU share's views too.
    augments_samples = False

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        path, label = self.folder.samples[index]
        sample = sample_key(index, epoch, self.seed)
        try:
            data = Path(path).read_bytes()
            geometry = jpeg_geometry(data)
            if not decoded_on_gpu(sample, self.gpu_share):
                return view_from_bytes(data, path, sample, self.side, self.train, self.augment, self.resize), None, \
                    label, "", ""
            if nvjpeg_can_decode(geometry):
                plan = view_plan(sample, geometry[0], geometry[1], self.side, self.train, self.augment, self.resize)
                return torch.frombuffer(bytearray(data), dtype=torch.uint8), plan, label, path, ""
            return view_from_bytes(data, path, sample, self.side, self.train, self.augment, self.resize), None, \
                label, path, ""
        except OSError as err:  # no fallback to name: BadFiles names the file
            return replacement(self.side), None, label, "", unreadable(path, err).entry
        except UnreadableImage as err:
            return replacement(self.side), None, label, "", err.entry

    def collate(self, samples: list) -> FileBatch:
        gpu = [i for i, s in enumerate(samples) if s[1] is not None]
        cpu = [i for i, s in enumerate(samples) if s[1] is None]
        encoded = [samples[i][0] for i in gpu]
        plans = [samples[i][1] for i in gpu]
        return FileBatch(
            torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8), [len(e) for e in encoded],
            plan_boxes(plans), torch.tensor([p.flip for p in plans], dtype=torch.bool),
            torch.tensor(gpu, dtype=torch.long),
            torch.stack([samples[i][0] for i in cpu]) if cpu else torch.empty(0, 3, self.side, self.side,
                                                                              dtype=torch.uint8),
            torch.tensor(cpu, dtype=torch.long), torch.tensor([s[2] for s in samples], dtype=torch.long),
            [samples[i][3] for i in gpu], next((samples[i][3] for i in cpu if samples[i][3]), ""),
            [s[4] for s in samples])

    # The device's decode is on trial for its first batches: a failure there (a torchvision without nvJPEG,
    # a driver error) moves the run to decoding on the CPU, with one warning, a slower run instead of a lost
    # one. Once it has worked, a failure is raised: it is an error of the run, not the path's absence.
    TRIAL_BATCHES = 4
    decoded_on_device = 0
    on_cpu_instead = ""  # why the run decodes on the CPU ("" while the device decodes)

    DECODE_AHEAD = 2  # batches the decoding thread may have ready: one for the step, one decoding meanwhile

    def stage(self, loader, device: torch.device):
        """The loader's FileBatches as (uint8 images, labels) on the device, decoded by a thread of this process
        on a side stream, up to DECODE_AHEAD batches ahead of the step that takes them (the same on the CPU,
        without streams: tests run it there)."""
        ahead = _DecodingThread(self, iter(loader), device, self.DECODE_AHEAD)
        try:
            while True:
                item = ahead.next()
                if item is None:
                    return
                yield _handed_over(*item)
        finally:
            ahead.close()

    def _decoded(self, batch: FileBatch, device: torch.device, stream):
        """One batch decoded on the decoding thread: (views, labels) and the event that marks them done."""
        with torch.cuda.stream(stream) if stream is not None else _no_stream():
            ready = self._views(batch, device)
            event = torch.cuda.Event() if stream is not None else None
            if event is not None:
                event.record(stream)
        if batch.fallback:
            _warn_once(batch.fallback, "not a JPEG nvJPEG decodes: viewed on the CPU")
        return ready, event


    def _views(self, batch: FileBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.on_cpu_instead:
            try:
                ready = decode_views(batch, device, self.side)
            except UnreadableImage:
                raise
            except Exception as err:  # whatever the device's decode raises, on trial
                if self.decoded_on_device >= self.TRIAL_BATCHES:
                    raise
                self.on_cpu_instead = first_line(err)
                log.warning("--decode gpu: the device's decode failed in batch %d (%s): this run decodes on the "
                            "CPU instead, in the training process (--decode cpu decodes in the loader's workers, "
                            "faster)", self.decoded_on_device + 1, self.on_cpu_instead)
            else:
                self.decoded_on_device += 1
                return ready
        images, labels = views_on_cpu(batch, self.side)
        return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


class _DecodingThread:
    """Decodes the loader's batches ahead of the training thread, which takes them in order with next().
    An exception on the decoding thread (a bad file, a failed decode past its trial) is raised by next(), in
    the training thread, as it would have been raised there; close() stops the thread and waits for it, so
    the loader's iterator (persistent workers reuse it) is free again before the next epoch takes it."""

    _END = object()

    def __init__(self, folder: "GpuImageFolder", batches, device: torch.device, ahead: int):
        self.folder, self.batches, self.device = folder, batches, device
        self.ready: queue.Queue = queue.Queue(maxsize=ahead)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainer-gpu-decode", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cuda = self.device.type == "cuda"
        try:
            stream = None
            if cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
                stream = torch.cuda.Stream(self.device)
            for batch in self.batches:
                if self.stopping.is_set():
                    return
                self._put(self.folder._decoded(batch, self.device, stream))
            self._put(self._END)
        except BaseException as err:  # noqa: BLE001 (raised again in the training thread, by next())
            self._put(err)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self):
        """The next (views, event) in the loader's order; None at the end."""
        item = self.ready.get()
        if item is self._END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stopping.set()
        while self.thread.is_alive():
            try:
                while True:
                    self.ready.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(0.05)


class _no_stream:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _handed_over(ready: tuple[torch.Tensor, torch.Tensor], event) -> tuple[torch.Tensor, torch.Tensor]:
    if event is not None:  # the training stream waits for the side stream's work, and owns its tensors now
        current = torch.cuda.current_stream()
        current.wait_event(event)
        for t in ready:
            t.record_stream(current)
    return ready


def plan_boxes(plans: list[ViewPlan]) -> torch.Tensor:
    return torch.tensor([[p.left, p.top, p.left + p.width, p.top + p.height] for p in plans],
                        dtype=torch.float32).reshape(-1, 4)


PAD_BUDGET_BYTES = 1 << 30  # the padded batch roi_align reads: images of one kernel call share this


def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, side: int) -> torch.Tensor:
    """Each uint8 C x H x W image's box (x0, y0, x1, y1) resized to side x side and flipped where asked:
    uint8 N x C x side x side, in one roi_align (plus a pad and a flip) per group of images whose padded
    batch fits PAD_BUDGET_BYTES. roi_align averages ceil(box/side)^2 bilinear samples per output pixel,
    an antialiased downscale; upscaling is bilinear."""
    from torchvision.ops import roi_align

    if not images:
        return torch.empty(0, 3, side, side, dtype=torch.uint8, device=boxes.device)
    device = images[0].device
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    out = []
    start = 0
    while start < len(images):
        stop, height, width = start, 0, 0
        while stop < len(images):
            h, w = max(height, images[stop].shape[1]), max(width, images[stop].shape[2])
            if stop > start and (stop + 1 - start) * 3 * h * w * dtype.itemsize > PAD_BUDGET_BYTES:
                break
            height, width, stop = h, w, stop + 1
        padded = torch.empty(stop - start, 3, height, width, dtype=dtype, device=device)
        for i, image in enumerate(images[start:stop]):
            # Edges replicated, not zeros: bilinear samples at a box's far edge must not read black.
            h, w = image.shape[1:]
            padded[i, :, :h, :w] = image
            padded[i, :, :h, w:] = padded[i, :, :h, w - 1:w]
            padded[i, :, h:, :] = padded[i, :, h - 1:h, :]
        rois = torch.cat([torch.arange(stop - start, dtype=torch.float32, device=device)[:, None],
                          boxes[start:stop].to(device)], dim=1).to(dtype)
        out.append(roi_align(padded, rois, (side, side), spatial_scale=1.0, sampling_ratio=-1, aligned=True))
        start = stop
    crops = torch.cat(out)
    crops = torch.where(flips.to(device)[:, None, None, None], crops.flip(-1), crops)
    return crops.round_().clamp_(0, 255).to(torch.uint8)


def decode_views(batch: FileBatch, device: torch.device, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A FileBatch's views on the device: nvJPEG for the encoded ones (batched), the CPU's views for the rest."""
    images = torch.empty(len(batch.labels), 3, side, side, dtype=torch.uint8, device=device)
    if len(batch.on_cpu):
        images[batch.on_cpu.to(device, non_blocking=True)] = batch.viewed.to(device, non_blocking=True)
    if batch.lengths:
        decoded = decode_jpegs(batch.encoded, batch.paths, device)
        crops = resized_crops(decoded, batch.boxes, batch.flips, side)
        images[batch.on_gpu.to(device, non_blocking=True)] = crops
    return images, batch.labels.to(device, non_blocking=True)


def views_on_cpu(batch: FileBatch, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_views without the device's decoder: PIL decodes, the CPU crops (the same boxes and flips)."""
    images = torch.empty(len(batch.labels), 3, side, side, dtype=torch.uint8)
    if len(batch.on_cpu):
        images[batch.on_cpu] = batch.viewed
    if batch.lengths:
        decoded = [decode_on_cpu(data.numpy().tobytes(), path) for data, path in zip(batch.encoded, batch.paths)]
        images[batch.on_gpu] = resized_crops(decoded, batch.boxes, batch.flips, side)
    return images, batch.labels


def decode_jpegs(encoded: list[torch.Tensor], paths: list[str], device: torch.device) -> list[torch.Tensor]:
    """Batched decode; a batch nvJPEG refuses as a whole is decoded one by one, and a file it refuses
    alone is decoded by PIL (or named, if PIL cannot either). When it refuses every file of a batch of
    several, the decoder is what fails, not the files: that is raised."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    images, refused, first_error = [], 0, None
    for data, path in zip(encoded, paths):
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError as err:
            refused, first_error = refused + 1, first_error or err
            if refused == len(encoded) > 1:
                raise first_error from None
            _warn_once(path, "a JPEG nvJPEG cannot decode: decoded on the CPU")
            images.append(decode_on_cpu(data.numpy().tobytes(), path).to(device))
    return images


def decode_on_cpu(data: bytes, path: str) -> torch.Tensor:
    """The whole image, uint8 3 x H x W, by PIL; a file PIL cannot decode either is a black pixel (any view of it
    is black), named in images.UNDECODED_HERE for the batches' reader."""
    from PIL import Image

    try:
        return pil_tensor(pil_rgb(Image.open(io.BytesIO(data)), path))
    except (OSError, SyntaxError, ValueError) as err:
        UNDECODED_HERE.append(unreadable(path, err, data).entry)
        return replacement(1)

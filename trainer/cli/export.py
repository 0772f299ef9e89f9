"""`trainer-export SRC OUT`: any checkpoint of the built-in trainer as one plain state_dict for inference.

    trainer-export checkpoints/step-00000500.pt model.pt     # a --strategy ddp checkpoint file
    trainer-export checkpoints/step-00000500 model.pt        # a --strategy fsdp checkpoint directory
    trainer-export checkpoints model.pt                      # a --checkpoint-dir: its newest committed one
    trainer-export checkpoints model.safetensors             # safetensors (pip install safetensors)
    trainer-export --ema checkpoints model.pt                # the --model-ema average's weights instead

OUT loads with torch.load(OUT, weights_only=True) straight into the unwrapped model:
`torchvision.models.resnet50(num_classes=...).load_state_dict(torch.load("model.pt", weights_only=True))`.
One process, no process group, no GPU: a sharded checkpoint of any world size is gathered here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error, os_reason
from trainer.core.files import replacing


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="trainer-export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("src", type=Path, help="a checkpoint file, a checkpoint directory, or a --checkpoint-dir")
    parser.add_argument("out", type=Path, help="the state_dict file to write (.safetensors: safetensors format)")
    parser.add_argument("--ema", action="store_true", help="the --model-ema average of the weights (what "
                        "torchvision publishes for its recipe) instead of the model's own")
    return parser.parse_args(argv)


def resolve(src: Path) -> Path:
    """The one checkpoint SRC names."""
    from trainer.checkpoint import store as checkpoint

    if not src.exists():
        raise UsageError("SRC", f"'{src}' does not exist", "give a checkpoint file or directory, or a --checkpoint-dir")
    if src.is_file() or checkpoint.NAME.match(src.name):
        return src
    newest = checkpoint.list_checkpoints(src)
    if not newest:
        raise UsageError("SRC", f"{src} holds no committed checkpoint",
                         "give a --checkpoint-dir with step-* checkpoints, or one checkpoint")
    return newest[0]


def model_state(path: Path, ema: bool = False) -> dict:
    from trainer.checkpoint import sharded, store as checkpoint

    try:
        state = checkpoint.load_ours(path)
        if ema:
            return averaged_state(path, state)
        return sharded.full_model_state(path) if path.is_dir() else state["model"]
    except UsageError:
        raise
    except OSError as err:
        raise UsageError("SRC", f"cannot read {path} ({os_reason(err)})", "make it readable") from None
    except Exception as err:  # noqa: BLE001 (pickle, zip, DCP errors: all mean "not a loadable checkpoint")
        raise UsageError("SRC", f"'{path}' is not a loadable checkpoint ({checkpoint.why_not(err)})",
                         "give a checkpoint written by this trainer") from None


def averaged_state(path: Path, state: dict) -> dict:
    """The model_ema average's weights and buffers, named as the model's (AveragedModel keeps the model under
    `module.` and counts its updates in n_averaged)."""
    from trainer.engine.ema import NAME

    if NAME not in state:
        raise UsageError("--ema", f"{path} holds no average of the weights", "export it without --ema, or train with "
                         "--model-ema")
    return {key.removeprefix("module."): value for key, value in state[NAME].items() if key != "n_averaged"}


def write(state: dict, out: Path) -> None:
    """Temp file and rename: OUT is the whole state or absent."""
    import torch

    def save(path: Path) -> None:
        if out.suffix == ".safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise UsageError("OUT", "safetensors is not installed", "pip install safetensors, or write a .pt "
                                 "file") from None
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        else:
            torch.save(state, path)

    try:
        with replacing(out) as temp:
            save(temp)
    except OSError as err:
        raise UsageError("OUT", f"cannot write {out} ({os_reason(err)})", "give a writable path") from None


def main(argv: list[str] | None = None) -> int:
    with exit_on_usage_error():
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.out.exists() and args.out.is_dir():
            raise UsageError("OUT", f"'{args.out}' is a directory", "give a file path such as model.pt")
        path = resolve(args.src)
        import torch

        state = {k: v.detach().to("cpu", copy=True) for k, v in model_state(path, args.ema).items()
                 if isinstance(v, torch.Tensor)}
        write(state, args.out)
    print(f"{args.out}: {len(state)} tensors from {path} ({sum(t.numel() for t in state.values()):,} values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

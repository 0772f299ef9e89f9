"""The software every rank must share: each rank's fingerprint, and the one line naming what differs.

Torch is imported only inside version_fingerprint (the doctor reads the CPU row without it)."""

from __future__ import annotations

import platform


def version_fingerprint() -> dict:
    """Versions that must match on every rank; the trainer all-gathers this at start-up."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 (NCCL missing from this build: report it as absent)
            pass
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "python": platform.python_version()}


def cpu_versions() -> dict:
    """The versions row without importing torch (no GPU: CUDA and NCCL do not apply)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return {"torch": torch_version, "cuda": None, "nccl": None, "python": platform.python_version()}


def check_same_versions(fingerprints: list[dict]) -> str | None:
    """One line naming which ranks (list index) differ in what; None when all are identical."""
    diffs = []
    for key in sorted({k for fp in fingerprints for k in fp}):
        groups: dict[str, list[str]] = {}
        for rank, fp in enumerate(fingerprints):
            groups.setdefault(str(fp.get(key)), []).append(str(rank))
        if len(groups) > 1:
            diffs.append(f"{key} " + " vs ".join(
                f"{v} on rank{'s' * (len(r) > 1)} {','.join(r)}" for v, r in groups.items()))
    if not diffs:
        return None
    return f"version mismatch across ranks: {'; '.join(diffs)} (run the same image everywhere)"

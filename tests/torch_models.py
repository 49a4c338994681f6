"""Torch models the tests and benchmarks export themselves (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path


def export_mlp(path: Path) -> Path:
    """Write an exported MLP (384 -> 1536 -> 384, GELU, fixed-seed random weights) with a
    dynamic batch dim to ``path`` (a ``.pt2``): enough work per op for torch's intra-op
    threads to split."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(384, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 384)
    ).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (torch.zeros(2, 384),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path

"""Shared by the test_analysis*.py modules: seeded monitored runs and the helpers that read them."""

from __future__ import annotations

from pathlib import Path


# ---- analyze on a real run ----------------------------------------------------------------------------
def _check_png(path: str) -> None:
    from matplotlib import image

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 8_000, f"{path}: {len(data)} bytes"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert float(pixels[..., :3].std()) > 0.05, f"{path}: an (almost) single-colour image"

"""Render the README's gallery picture(s) to PNG with the system's headless Chromium.

    python docs/render_gallery.py            # writes docs/all_gather.png
    python docs/render_gallery.py --out /tmp # somewhere else

Each figure is written with ``fig.write_html`` (plotly.js inlined, so no
network is needed) and screenshotted by Playwright driving
``/usr/bin/chromium``; no browser is downloaded.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from simcomm.viz import collective_figure

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

GALLERY = {
    "all_gather.png": lambda: collective_figure("all_gather", world_size=4, shape=(2, 2)),
}


def render(figures: dict, out_dir: Path, scale: float = 1.0) -> list[Path]:
    """Screenshot each figure at its own width and height; return the PNG paths."""
    written = []
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as tmp:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for name, make in figures.items():
                fig = make()
                html = Path(tmp) / (Path(name).stem + ".html")
                fig.write_html(html, include_plotlyjs=True, full_html=True,
                               config={"displayModeBar": False, "staticPlot": True})
                page = browser.new_page(viewport={"width": int(fig.layout.width), "height": int(fig.layout.height)},
                                        device_scale_factor=scale)
                page.goto(html.as_uri())
                page.wait_for_selector(".main-svg")
                path = out_dir / name
                page.locator(".plotly-graph-div").screenshot(path=str(path))
                page.close()
                written.append(path)
        finally:
            browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--scale", type=float, default=1.0, help="device pixel ratio of the screenshot")
    args = parser.parse_args()
    for path in render(GALLERY, args.out, args.scale):
        print(f"{path}  {path.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()

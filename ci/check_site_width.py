"""Check in headless Chromium that the main pages of the built site do not scroll sideways, and screenshot them.

    python ci/check_site_width.py SITE_DIR [--screenshots DIR] [--width 1280]

Each page is opened at a desktop width with a script that lists every code block, table and the page itself whose
content is wider than its box (scrollWidth > clientWidth: a horizontal scrollbar). Prints the offenders and exits 1
when there are any; 2 when Chromium is missing. Run by tests/test_docs_site.py on a freshly built site.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The pages a newcomer reads first: the home page, getting started, the front-door guides and the API reference.
MAIN_PAGES = (
    "index.html",
    "getting-started/index.html",
    "guides/hugging-face/index.html",
    "guides/optimizer-offload/index.html",
    "guides/parameter-streaming/index.html",
    "reference/api/index.html",
)
PROBE = """<script>
window.addEventListener("load", () => {
  const wide = [];
  const check = (el, what) => {
    if (el.scrollWidth > el.clientWidth + 1)
      wide.push({what, overflow: el.scrollWidth - el.clientWidth, text: (el.innerText || "").slice(0, 100)});
  };
  check(document.scrollingElement, "page");
  document.querySelectorAll("pre > code, .md-typeset__scrollwrap, table").forEach(el => check(el, el.tagName));
  const out = document.createElement("pre");
  out.id = "width-report";
  out.textContent = JSON.stringify(wide);
  document.body.appendChild(out);
});
</script></body>"""


def chromium() -> str | None:
    """The Chromium (or Chrome) executable, or None."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def overflowing(browser: str, page: Path, width: int, screenshot: Path | None) -> list[dict]:
    """The elements of ``page`` wider than their box at ``width`` CSS pixels."""
    probe = page.with_name(f".width-probe-{page.name}")
    probe.write_text(page.read_text().replace("</body>", PROBE, 1))
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},1000"]
    try:
        with tempfile.TemporaryDirectory() as profile:
            args = [*common, f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
            dom = subprocess.run([*args, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
            if screenshot is not None:
                subprocess.run([*args, f"--screenshot={screenshot}", page.as_uri()], capture_output=True, timeout=120)
    finally:
        probe.unlink()
    match = re.search(r'<pre id="width-report">(.*?)</pre>', dom.stdout, re.S)
    if match is None:
        raise RuntimeError(f"{page}: no report from Chromium: {dom.stderr[-1000:]}")
    import html

    return json.loads(html.unescape(match.group(1)))


def main() -> int:
    """Check the main pages; print what scrolls sideways; 0, 1 (some do) or 2 (no Chromium)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--screenshots", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args()
    browser = chromium()
    if browser is None:
        print("no chromium here (apt-get install chromium)", file=sys.stderr)
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in MAIN_PAGES:
        shot = args.screenshots / (name.replace("/", "_").replace(".html", ".png")) if args.screenshots else None
        wide = overflowing(browser, args.site / name, args.width, shot)
        print(f"{name}: {'scrolls sideways' if wide else 'fits'} at {args.width} px")
        for item in wide:
            print(f"  {item['what']} {item['overflow']} px too wide: {item['text']!r}")
        failed += bool(wide)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

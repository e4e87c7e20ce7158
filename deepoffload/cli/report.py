"""``deepoffload report``: which ops work here, which engines, and for each missing piece why and how to get it.

The facts come from ``deepoffload.diagnostics``; this module renders them as text or JSON.

Warm (probes cached) it runs no compiler and does not import torch; it never builds the op. When the op is already
built (prebuilt or in the cache) it is loaded, which takes milliseconds, and each engine's runtime self-test is run.
Exit status: 0 when the async-IO op can be used here (and in the ``--path`` folder, when given), 1 when not.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..diagnostics import gather
from ..op_builder import env
from .options import add_folders


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``deepoffload report``'s options to ``parser``.

    Args:
        parser: The command's subparser.
    """
    add_folders(
        parser,
        "also check this folder: free space, filesystem, device, O_DIRECT (repeat for each drive's folder)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--no-probe-cache", action="store_true", help="run the probes again instead of using the cache")


# -- rendering ----------------------------------------------------------------------------------------------------
class Style:
    """Colours for the terminal: green, red and dim text (ANSI codes), or plain text.

    Args:
        enabled: Whether to colour (False: every method returns its text as it is).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def ok(self, text: str) -> str:
        """``text`` in green."""
        return self._wrap("32", text)

    def bad(self, text: str) -> str:
        """``text`` in red."""
        return self._wrap("31", text)

    def dim(self, text: str) -> str:
        """``text`` dimmed."""
        return self._wrap("2", text)


def _table(rows: list[list[str]], header: list[str]) -> str:
    import re

    visible = lambda s: len(re.sub(r"\033\[[0-9;]*m", "", s))  # noqa: E731
    widths = [max(visible(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(cell + " " * (widths[i] - visible(cell)) for i, cell in enumerate(r)).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(report: dict, style: Style) -> str:
    """The report as text: the ops table, each op's probes with install hints, the versions and the folder check.

    Args:
        report: ``deepoffload.diagnostics.gather()``'s report.
        style: The colours to use.

    Returns:
        The text.
    """
    out = []
    yes = lambda b: style.ok("yes") if b else style.bad("no")  # noqa: E731
    op_rows = []
    for op in report["ops"]:
        if op["engines"]:
            engines = ", ".join(
                e if s["ok"] else f"{e} ({style.bad('fails self-test')})" for e, s in op["engines"].items()
            )
        else:
            engines = ", ".join(op["engines_buildable"]) + style.dim(" (when built)")
        op_rows.append(
            [
                op["name"],
                yes(op["installed"]),
                yes(op["compatible"]),
                op["built"] and ("prebuilt" if op["built"] == "prebuilt" else "yes (cache)") or "not yet",
                engines,
            ]
        )
    out.append(_table(op_rows, ["op", "prebuilt", "compatible", "built", "engines"]))
    paint = {"ok": style.ok, "fails": style.bad, "when built": style.dim, "not compiled in": style.dim}
    engine_rows = [[e["name"], paint[e["state"]](e["state"]), e["description"]] for e in report.get("engines", [])]
    if engine_rows:
        out.append("")
        out.append(_table(engine_rows, ["engine", "here", "what it is"]))
    for op in report["ops"]:
        out.append("")
        out.append(f"{op['name']} probes:")
        rows = []
        for name, p in op["probes"].items():
            status = {"ok": style.ok("ok"), "missing": style.bad("missing"), "n/a": style.dim("n/a")}[p["status"]]
            rows.append([name, status, p["reason"] if p["status"] != "ok" else ""])
        out.append(_table(rows, ["probe", "status", "reason"]))
        for name, p in op["probes"].items():
            if p["status"] == "missing":
                out.append(f"  {name}: {p['hint']}")
        if op["auto_engine"]:
            out.append(f"engine 'auto' selects: {style.ok(op['auto_engine'])}")
        for engine, s in op["engines"].items():
            if not s["ok"]:
                out.append(f"  {engine} self-test failed: {s['reason']}")
        if op.get("prebuilt_mismatch"):
            out.append(style.dim(op["prebuilt_mismatch"]))
        if op.get("load_error"):
            out.append(style.bad(f"the built op does not load: {op['load_error']}"))
        if not op["built"] and op["compatible"]:
            out.append(style.dim("the op builds on first use (or prebuild it: see docs/concepts/building.md)"))
    out.append("")
    out.append(
        _table(
            [[k, str(v) if v is not None else style.dim("not found")] for k, v in report["versions"].items()],
            ["version", "value"],
        )
    )
    if report.get("checkpoint_formats"):
        out.append("")
        rows = [[f["name"], yes(f["reads"]), yes(f["writes"]), f["description"]] for f in report["checkpoint_formats"]]
        out.append(_table(rows, ["checkpoint format", "read", "written", "what it is"]))
    if report.get("extensions"):
        out.append("")
        rows = [[e["kind"], e["name"], e["description"]] for e in report["extensions"]]
        out.append(_table(rows, ["extension", "name", "what it is"]))
    if "path" in report:
        p = report["path"]
        out.append("")
        if "error" in p:
            out.append(style.bad(f"{p['path']}: {p['error']}"))
        else:
            direct = (
                style.ok(f"yes, alignment {p['alignment']} bytes")
                if p["direct_io"]
                else style.bad(f"no ({p['direct_io_reason']})")
            )
            out.append(
                _table(
                    [
                        ["folder", p["path"]],
                        ["filesystem", f"{p['filesystem']} (mounted at {p['mount']})"],
                        ["free", f"{p['free_bytes'] / 1e9:.1f} GB of {p['total_bytes'] / 1e9:.1f} GB"],
                        ["writable", yes(p["writable"])],
                        ["O_DIRECT", direct],
                    ],
                    ["path check", "value"],
                )
            )
    if len(report.get("folders", [])) > 1:
        out.append("")
        out.append(_table([_folder_row(f, style) for f in report["folders"]], FOLDER_HEADER))
    return "\n".join(out)


FOLDER_HEADER = ["swap folder", "filesystem", "device", "free", "O_DIRECT", "drive"]


def _folder_row(folder: dict, style: Style) -> list[str]:
    if "error" in folder:
        return [folder["path"], style.bad(folder["error"]), "", "", "", ""]
    direct = style.ok("yes") if folder["direct_io"] else style.bad(f"no ({folder['direct_io_reason']})")
    drive = (
        folder["drive"] if folder["same_device_as"] is None else style.bad(f"same device as {folder['same_device_as']}")
    )
    return [
        folder["path"],
        f"{folder['filesystem']} ({folder['mount']})",
        folder["device"],
        f"{folder['free_bytes'] / 1e9:.1f} GB",
        direct,
        str(drive),
    ]


def folder_rows(paths: list[str]) -> list[dict]:
    """``path_status`` of each swap folder, with the drive it counts as (``SwapConfig(folder=[...])``).

    Args:
        paths: The folders, in the order a folder list gives them.

    Returns:
        One row per folder: ``path_status``'s keys plus ``drive`` (its index among distinct devices) and
        ``same_device_as`` (the earlier folder on its device, whose drive it is counted as; else None).
    """
    from ..diagnostics import path_status

    rows: list[dict] = []
    seen: dict[str, str] = {}
    for path in paths:
        row = path_status(path)
        row["same_device_as"] = row["drive"] = None
        if "error" not in row:
            row["same_device_as"] = seen.get(row["device"])
            seen.setdefault(row["device"], path)
            row["drive"] = list(seen).index(row["device"])
        rows.append(row)
    return rows


def checkpoint_format_rows() -> list[dict]:
    """The registered checkpoint formats, in the order they are tried (``deepoffload.formats.registry``).

    Returns:
        One ``{"name", "description", "reads", "writes"}`` per format.
    """
    from ..formats.registry import checkpoint_formats  # (imports no torch)

    return [
        {"name": f.name, "description": f.description, "reads": f.reads, "writes": f.writes}
        for f in checkpoint_formats()
    ]


def extension_rows() -> list[dict]:
    """The registered storage layouts and byte codecs (``SwapConfig(layout=, codec=)``), from their registries.

    Returns:
        One ``{"kind", "name", "description"}`` per layout, then per codec (registries that import no torch).
    """
    from ..swap.codecs import codec_class, codec_names
    from ..swap.layouts import layout_class, layout_names

    rows = [{"kind": "storage layout", "name": n, "description": layout_class(n).description} for n in layout_names()]
    return rows + [{"kind": "byte codec", "name": n, "description": codec_class(n).description} for n in codec_names()]


def usable(report: dict) -> bool:
    """True when the async-IO op can be used here: compatible, and it loads when built."""
    op = next(o for o in report["ops"] if o["name"] == "async_io")
    return bool(op["compatible"] and not op.get("load_error"))


def run(args: argparse.Namespace) -> int:
    """Runs ``deepoffload report``: gathers the facts and prints them as text (coloured on a terminal) or JSON.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 when the async-IO op can be used here (and in every ``--path`` folder), 1 when not.
    """
    paths = args.path or []
    report = gather(paths[0] if paths else None, use_cache=not args.no_probe_cache)
    report["checkpoint_formats"] = checkpoint_format_rows()
    report["extensions"] = extension_rows()
    if len(paths) > 1:
        report["folders"] = folder_rows(paths)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        color = sys.stdout.isatty() and not env.get("NO_COLOR")
        print(render(report, Style(color)))
    path_ok = all("error" not in f for f in report.get("folders", [report.get("path") or {}]))
    return 0 if usable(report) and path_ok else 1

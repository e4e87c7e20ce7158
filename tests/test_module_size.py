"""Library modules stay short (one job each): no file of ``deepoffload/`` or ``op_builder/`` over 500 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def long_modules(root: Path = ROOT) -> list[str]:
    found = []
    for folder in ("deepoffload", "op_builder"):
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > LIMIT:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_library_module_over_500_lines():
    assert long_modules() == [], "split these by job: " + "; ".join(long_modules())


def test_the_check_finds_a_long_module(tmp_path):
    (tmp_path / "deepoffload").mkdir()
    (tmp_path / "deepoffload" / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "deepoffload" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    assert long_modules(tmp_path) == [f"deepoffload/long.py: {LIMIT + 1} lines"]

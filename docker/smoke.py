"""Smoke check of an installed stallfree: every module of the image's role imports, and the CLI answers.

    python docker/smoke.py engine|operator

Run by docker/install.sh after the install, from a folder outside the source tree, so that what is checked is
the installed package, not a checkout beside it. A module the wheel left out, or a dependency the role's
extra does not declare, fails here, at image build, rather than in a pod at start-up.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# role -> (packages whose every module must import, subpackages left out of the walk).
# The engine image carries the operator's code but not its extra (kopf, kubernetes): it never runs it.
# The operator image has no torch: it runs the operator and the cost model its controller plans with.
ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "engine": (("stallfree",), ("stallfree.operator",)),
    "operator": (("stallfree.operator", "stallfree.costmodel", "stallfree.cli"), ()),
}
# role -> `stallfree ...` commands that must exit 0
COMMANDS = {
    "engine": (["--help"], ["serve", "--help"], ["generate", "--help"]),
    "operator": (["--help"], ["operator", "--help"]),
}


def modules(package: str, skip: tuple[str, ...] = ()) -> Iterator[str]:
    """`package` and every module under it (imported as it goes, to find subpackages), minus `skip` and
    __main__ modules (importing those runs them)."""
    mod = importlib.import_module(package)
    yield package
    for info in pkgutil.iter_modules(getattr(mod, "__path__", []), package + "."):
        if info.name.endswith(".__main__") or any(
            info.name == s or info.name.startswith(s + ".") for s in skip
        ):
            continue
        if info.ispkg:
            yield from modules(info.name, skip)
        else:
            importlib.import_module(info.name)
            yield info.name


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ROLES:
        print(f"usage: smoke.py {'|'.join(ROLES)}", file=sys.stderr)
        return 2
    role = argv[0]
    import stallfree

    print(f"smoke: stallfree {stallfree.__version__} from {stallfree.__file__}")
    roots, skip = ROLES[role]
    names = [name for root in roots for name in modules(root, skip)]
    print(f"smoke: {len(names)} modules import")
    exe = shutil.which("stallfree", path=str(Path(sys.executable).parent))
    if exe is None:
        print(f"smoke: no `stallfree` script beside {sys.executable}", file=sys.stderr)
        return 1
    for args in COMMANDS[role]:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            print(
                f"smoke: `stallfree {' '.join(args)}` exited {proc.returncode}:\n{proc.stderr}",
                file=sys.stderr,
            )
            return 1
        print(f"smoke: `stallfree {' '.join(args)}` ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Before Qt starts: are the system libraries of its platform plugin here?

On Linux, Qt's xcb plugin needs libraries that desktop installations usually have but minimal
ones may not (libxcb-cursor0, libxcb-icccm4, ...). Without them Qt prints "could not load the
Qt platform plugin "xcb" ... no Qt platform plugin could be initialized" and aborts the
process, naming neither the library nor the package. This module loads the plugin the way Qt
would (``ctypes``, which resolves its dependencies through the same search path) before any
QApplication exists, and turns a failure into one message naming the libraries and the
Debian/Ubuntu packages that provide them.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from slideformer.engine.api import UserError

# Packages whose names do not follow Debian's rule (libfoo.so.N -> libfooN, libfoo2.so.N ->
# libfoo2-N) or that are best installed by another name.
PACKAGES = {"libglib-2.0.so.0": "libglib2.0-0", "libgthread-2.0.so.0": "libglib2.0-0",
            "libX11-xcb.so.1": "libx11-xcb1", "libX11.so.6": "libx11-6",
            "libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libOpenGL.so.0": "libopengl0",
            "libz.so.1": "zlib1g"}


def package_of(soname: str) -> str:
    """The Debian/Ubuntu package that ships ``soname`` ("libxcb-cursor.so.0" -> "libxcb-cursor0")."""
    if soname in PACKAGES:
        return PACKAGES[soname]
    m = re.fullmatch(r"(lib.+?)\.so\.(\d+).*", soname)
    if not m:
        return soname
    name, major = m.group(1).lower(), m.group(2)
    if name.startswith("libicu"):  # libicuuc, libicudata, libicui18n: one package per version
        return f"libicu{major}"
    return f"{name}-{major}" if name[-1].isdigit() else f"{name}{major}"


def platform_name() -> str:
    """The platform plugin Qt will load: QT_QPA_PLATFORM, else the session's (xcb on X11)."""
    chosen = os.environ.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0].strip()
    if chosen:
        return chosen
    if os.environ.get("WAYLAND_DISPLAY") and not os.environ.get("DISPLAY"):
        return "wayland"
    return "xcb"


def plugin_path(platform: str) -> Path | None:
    """The file of PySide6's ``platform`` plugin, if it is there."""
    try:
        import PySide6
    except ImportError:
        return None
    found = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / f"libq{platform}.so"
    return found if found.is_file() else None


def missing_libraries(plugin: Path) -> list[str]:
    """Shared libraries ``plugin`` needs that cannot be loaded ([] when it loads)."""
    try:
        ctypes.CDLL(str(plugin))
        return []
    except OSError as e:
        first = re.findall(r"(lib[\w.+-]+\.so[\w.]*): cannot open", str(e))
    missing = list(first)
    if shutil.which("ldd"):  # every missing one at once, not only the first the loader met
        out = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True).stdout
        missing += [m for m in re.findall(r"^\s*(\S+) => not found", out, re.M) if m not in missing]
    return missing or ["(a library the loader did not name)"]


def check_platform() -> None:
    """Raise a UserError naming what to install when Qt's platform plugin cannot load."""
    if not sys.platform.startswith("linux"):
        return
    platform = platform_name()
    plugin = plugin_path(platform)
    if platform in ("offscreen", "minimal") or plugin is None:
        return  # built into every installation / not ours to check
    missing = missing_libraries(plugin)
    if not missing:
        return
    packages = sorted({package_of(m) for m in missing
                       if m.startswith("lib") and not m.startswith("libQt6")})
    fixes = [f"install the system libraries (Debian/Ubuntu: sudo apt-get install "
             f"{' '.join(packages)})"] if packages else []
    if any(m.startswith("libQt6") for m in missing) or not packages:  # PySide6's own files
        fixes.append("reinstall Qt for Python (pip install --force-reinstall PySide6-Essentials)")
    raise UserError(f"Qt platform \"{platform}\"", "cannot start: the system lacks "
                    f"{', '.join(missing)}", "; ".join(fixes) + "; the README lists the system "
                    "packages")
